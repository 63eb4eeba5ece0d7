"""vLLM's own acceptance counters for a trained export against the offline walk, on the same prompts.

    specdistill-eval served --run RUN_DIR --method dflash|eagle3|mtp --rows heldout.jsonl \
        [--drafter NAME] [--prompts 8] [--max-tokens 32] [--target DIR] [--max-model-len N]

--drafter names the drafter of a `drafters=[...]` run (its export/<name>/); a one-drafter run needs none.

1. the target alone, greedy, max_tokens + K: its continuations (an engine verifies a draft past max_tokens and
   then truncates, so the walk needs the K tokens beyond);
2. the target with the export (method passed explicitly), max_tokens: vLLM's counters;
3. the offline walk (specdistill.evaluation.acceptance, the code behind metrics.json's tau_offline) over prompt + continuation,
   max_generated = max_tokens, so it follows vLLM's decode path step for step.
Prints `name: value` lines, last `gap_pct` = 100 (tau_vllm_per_step - tau_offline) / tau_offline. tau_vllm_per_step
is vLLM's tau corrected for steps without a draft (specdistill.evaluation.vllm_serve.ServeResult.tau_per_step).

Where the two differ (docs/acceptance.md "Near-ties"; measured in docs/choosing_a_drafter.md): fp32 targets match exactly; bf16 hybrid
targets differ by near-ties (vLLM's CPU kernels vs transformers' reference kernels give the target states the
walk reads), which flip single accepted tokens and shift the path after them. The command line:
specdistill/launch/evaluate.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from specdistill.evaluation.reload import drafter_metrics, export_dir
from specdistill.evaluation.vllm_serve import ServeResult, serve


def offline_on_continuations(run_dir, target_dir, prompts: list[list[int]], continuations: list[list[int]],
                             max_generated: int | None, stages: list[str] | None = None, name: str | None = None):
    """specdistill.evaluation.acceptance's report over rows prompt + continuation (loss on the continuation)."""
    import torch

    from specdistill.core.contract import TokenizedRow
    from specdistill.feature_server.config import FeatureServerConfig
    from specdistill.feature_server.server import FeatureServer
    from specdistill.evaluation.served import evaluate_as_served
    from specdistill.evaluation.reload import load_run

    drafter, head, _ = load_run(run_dir, target_dir, name)
    rows = [TokenizedRow(i, tuple(p + c), tuple([0] * len(p) + [1] * len(c)))
            for i, (p, c) in enumerate(zip(prompts, continuations, strict=True))]
    spec = drafter.feature_spec()
    with FeatureServer(str(target_dir), spec, rows, FeatureServerConfig(workers=1)) as server:
        return evaluate_as_served(drafter, head, server, spec, torch.device("cpu"),
                                  stages=dict(enumerate(stages)) if stages else None, max_generated=max_generated)


def served_vs_offline(run_dir, target_dir, method: str, prompts: list[list[int]], max_tokens: int,
                      stages: list[str] | None = None, base: ServeResult | None = None, timed: bool = False,
                      name: str | None = None, **engine_kwargs: Any) -> dict:
    """base (max_tokens + K), speculative (max_tokens) and the offline report; K from the run's drafter.

    timed: both runs also measure decode speed (ServeResult tokens_per_s_all / tokens_per_s_one).
    `base`: the target alone's greedy run on these prompts (max_tokens + K tokens each, ignore_eos) when the caller
    has one already; the served-drafter tests share one per target instead of starting an engine for each.
    name: the drafter of a `drafters=[...]` run (None: the run's only one)."""
    run_dir = Path(run_dir)
    K = drafter_metrics(run_dir, name)["num_speculative_tokens"]
    if base is None:
        base = serve(str(target_dir), prompts, max_tokens + K, ignore_eos=True, timed=timed, **engine_kwargs)
    elif len(base.output_token_ids) != len(prompts) or {len(o) for o in base.output_token_ids} != {max_tokens + K}:
        raise ValueError(f"base run: {len(base.output_token_ids)} outputs of lengths "
                         f"{sorted({len(o) for o in base.output_token_ids})}; need {len(prompts)} of {max_tokens + K}")
    spec = serve(str(target_dir), prompts, max_tokens, str(export_dir(run_dir, name)), method=method,
                 num_speculative_tokens=K, ignore_eos=True, timed=timed, **engine_kwargs)
    offline = offline_on_continuations(run_dir, target_dir, prompts, base.output_token_ids, max_tokens, stages,
                                       name)
    return dict(base=base, spec=spec, offline=offline, K=K, prompts=prompts, max_tokens=max_tokens)


def identical_prefixes(base: ServeResult, spec: ServeResult, max_tokens: int) -> int:
    """Prompts whose speculative output equals the first max_tokens tokens of the (longer) base output."""
    return sum(a[:max_tokens] == b for a, b in zip(base.output_token_ids, spec.output_token_ids, strict=True))


def report_lines(result: dict) -> list[str]:
    spec, offline = result["spec"], result["offline"].total
    c = spec.counters
    gap = 100.0 * (spec.tau_per_step - offline.tau) / offline.tau
    return [f"identical_outputs: {identical_prefixes(result['base'], spec, result['max_tokens'])}/{len(result['prompts'])}",
            f"vllm_drafts: {c.num_drafts}", f"vllm_accepted_per_pos: {' '.join(map(str, c.accepted_per_pos))}",
            f"offline_drafts: {offline.num_drafts}",
            f"offline_accepted_per_pos: {' '.join(map(str, offline.accepted_per_pos))}",
            *(f"tau_offline[{s}]: {r.tau:.3f}" for s, r in sorted(result["offline"].by_stage.items())),
            f"tau_vllm: {c.tau:.3f}", f"draft_fraction: {spec.draft_fraction:.3f}",
            f"tau_vllm_per_step: {spec.tau_per_step:.3f}", f"tau_offline: {offline.tau:.3f}", f"gap_pct: {gap:+.2f}"]
