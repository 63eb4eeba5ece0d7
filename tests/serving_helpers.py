"""Shared by the served-drafter tests (tests/test_serving.py, tests/drafters/test_eagle3.py, test_mtp.py,
test_dspark.py and test_dflash2.py on a GPU).

`served_run` serves a trained run's export on vLLM next to the target alone and walks the offline evaluator over
vLLM's own base outputs (specdistill.evaluation.served_acceptance.served_vs_offline), so the two sets of counters describe the same
decode path: equal on fp32 tiny-llama, within 5% on bf16 tiny-qwen3-next (docs/acceptance.md, docs/vllm.md).

The served runs of one target share their prompts (the first held-out rows of one workload), so the target alone
runs once per session on them (`TargetAloneRuns`, the conftest fixture `target_alone_runs`): a vLLM engine is
15-60 s to start on 2 cores, and six served exports would otherwise start six base engines for three answers.
"""

import dataclasses
import json
import os
import sys
from pathlib import Path

from specdistill.evaluation.prompts import read_prompts
from specdistill.evaluation.served_acceptance import served_vs_offline
from specdistill.evaluation.vllm_serve import ServeResult, serve
from specdistill.core.run_dir import RunDir
from specdistill.evaluation.reload import drafter_metrics

MAX_TOKENS, PROMPTS = 24, 6


def run_heldout_prompts(run_dir: Path, n: int = PROMPTS) -> list[list[int]]:
    """The first n held-out prompts of the run's workload (metrics.json records its path)."""
    heldout = json.loads(RunDir(run_dir).metrics.read_text())["skipped_rows"]["heldout"]["path"]
    return read_prompts(heldout, None, n)[0]


class TargetAloneRuns:
    """Greedy runs of a target alone on vLLM (ignore_eos), one engine per target and prompts for the session.

    A shorter run is the longer one's prefix: every request decodes to the same length, so each step schedules the
    same batch either way, and `get` truncates (K differs per drafter: MTP 5, DFlash and EAGLE-3 7)."""

    def __init__(self):
        self._runs: dict[tuple, ServeResult] = {}

    def get(self, target_dir: Path, prompts: list[list[int]], max_tokens: int) -> ServeResult:
        # Model Runner V2 (the GPU serving tests set it) is another engine: its runs are kept apart.
        key = (str(target_dir), tuple(map(tuple, prompts)), os.environ.get("VLLM_USE_V2_MODEL_RUNNER"))
        run = self._runs.get(key)
        if run is None or len(run.output_token_ids[0]) < max_tokens:
            run = self._runs[key] = serve(str(target_dir), prompts, max_tokens, ignore_eos=True)
        return dataclasses.replace(run, output_token_ids=[o[:max_tokens] for o in run.output_token_ids])


def served_run(name: str, run_dir: Path, target_dir: Path, method: str, target_alone: TargetAloneRuns,
               drafter: str | None = None) -> dict:
    """base / spec ServeResults, the offline AcceptanceCounts, K and the prompts of one trained run (of its drafter
    `drafter` for a drafters=[...] run)."""
    prompts = run_heldout_prompts(run_dir)
    K = drafter_metrics(run_dir, drafter)["num_speculative_tokens"]
    base = target_alone.get(target_dir, prompts, MAX_TOKENS + K)  # the walk reads K tokens past MAX_TOKENS
    result = served_vs_offline(run_dir, target_dir, method, prompts, MAX_TOKENS, base=base, name=drafter)
    return dict(name=name, target_dir=target_dir, run_dir=run_dir, prompts=prompts, base=result["base"],
                spec=result["spec"], offline=result["offline"].total, K=result["K"], drafter=drafter)


def assert_lossless(served: dict) -> None:
    """fp32 llama: every prompt identical. bf16 targets: a prompt may differ only where the first differing token
    is a near-tie of the base run's logits, scored by the fp32 reference (docs/acceptance.md, "Near-ties")."""
    from specdistill.evaluation.lossless import Reference

    base = [o[:MAX_TOKENS] for o in served["base"].output_token_ids]
    spec = served["spec"].output_token_ids
    differing = [i for i, (a, b) in enumerate(zip(base, spec, strict=True)) if a != b]
    if served["name"] == "tiny-llama":
        assert not differing, f"prompts {differing} differ on the fp32 target"
        return
    reference = Reference(str(served["target_dir"])) if differing else None
    for i in differing:
        d = reference.divergence(i, served["prompts"][i], base[i], spec[i])
        assert d.near_tie, f"prompt {i} differs at token {d.position} ({d.base_token} -> {d.spec_token}) with a " \
                           f"logit margin of {d.margin:.4f}: not a bf16 near-tie"


def assert_acceptance_matches_offline(served: dict) -> None:
    """Exact counters on fp32 tiny-llama; tau and draft counts within 5% on bf16 targets; and something accepted
    (a drafter that never drafts right would match any walk)."""
    vllm, ours = served["spec"].counters, served["offline"]
    print(f"{served['name']} {served['spec'].method} K={served['K']}: vLLM drafts {vllm.num_drafts} accepted "
          f"{vllm.accepted_per_pos} tau {vllm.tau:.3f} (per step {served['spec'].tau_per_step:.3f}); offline drafts "
          f"{ours.num_drafts} accepted {ours.accepted_per_pos} tau {ours.tau:.3f}", file=sys.stderr)
    assert vllm.num_accepted_tokens > 0 and ours.num_accepted > 0
    if served["name"] == "tiny-llama":
        assert vllm.num_drafts == ours.num_drafts
        assert list(vllm.accepted_per_pos) == ours.accepted_per_pos
    else:
        assert abs(vllm.tau - ours.tau) <= 0.05 * ours.tau
        assert abs(vllm.num_drafts - ours.num_drafts) <= 0.05 * ours.num_drafts


def workload_prompts(target_dir, n: int) -> tuple[list[list[int]], list[str]]:
    """n synthetic-workload prompts (120 tokens) tokenized with the target's chat template, and their stages: no
    generation needed, for serving tests that only send prompts."""
    from transformers import AutoTokenizer

    from specdistill.data.workload import generate_rows

    tok = AutoTokenizer.from_pretrained(str(target_dir))
    rows = generate_rows(n, split="heldout", prompt_tokens=120,
                         count_tokens=lambda s: len(tok(s, add_special_tokens=False)["input_ids"]))
    prompts = [tok(tok.apply_chat_template(r["messages"][:-1], tokenize=False, add_generation_prompt=True),
                   add_special_tokens=False)["input_ids"] for r in rows]
    return prompts, [r["stage"] for r in rows]


# A block drafter trained before serving (an untrained one is lossless trivially: nothing it drafts is accepted).
# Layers start fresh: on the templated tiny targets, layers copied from the target learn slower in 40 steps
# (tiny-llama: held-out a_1 0.24 vs 0.39), and the counters checks need a drafter that is accepted often.
SERVED_TRAIN = ["drafter.num_layers=1", "drafter.init_from_target=false", "data.rows=48", "data.heldout_rows=8",
                "data.prompt_tokens=120", "data.max_new_tokens=32", "trainer.token_budget=1024", "trainer.max_steps=40",
                "trainer.checkpoint_every=40", "trainer.warmup_steps=4", "trainer.progress=false"]


def serve_trained_export(tmp_path, cache_dir, tiny_target, target_alone: TargetAloneRuns, drafter: str,
                         method: str) -> None:
    """Train `drafter` on tiny-llama through the CLI, serve its export with vLLM on Model Runner V2 next to the
    target alone: greedy outputs equal the target's own, drafts are accepted, and vLLM's tau is within 5% of the
    offline walk on vLLM's own base outputs (tests/drafters/test_dspark.py, test_dflash2.py)."""
    from tests.cli import run_train

    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"  # V1 rejects both DSpark and DFlash 2
    target_dir = tiny_target("tiny-llama")
    run_dir = tmp_path / "run"
    run_train([f"drafter={drafter}", "target=tiny-llama", *SERVED_TRAIN, f"hydra.run.dir={run_dir}"], cache_dir)
    served = served_run("tiny-llama", run_dir, target_dir, method, target_alone)
    assert_lossless(served)
    vllm, ours = served["spec"].counters, served["offline"]
    assert served["spec"].num_speculative_tokens == served["K"]
    assert vllm.num_accepted_tokens > 0 and ours.num_accepted > 0, (vllm, ours)
    assert abs(vllm.tau - ours.tau) <= 0.05 * ours.tau, (vllm.tau, ours.tau)
