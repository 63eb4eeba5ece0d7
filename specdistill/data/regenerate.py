"""Your prompts, the target's answers: rows ready for `data=jsonl`, streamed, written as they finish, resumable.

    specdistill-regenerate target.path=DIR input=prompts.jsonl output=train.jsonl \
        [backend=auto|vllm|hf] [max_new_tokens=256] [temperature=0] [top_p=1] [stop=[...]] [batch_size=32] [seed=0]

A drafter must learn the target's outputs, not the dataset's: whatever wrote the responses in your file, this
replaces them by the target's own (greedy by default). Input rows (JSONL, Parquet or Arrow; any mix of formats):
  {"messages": [...]}                prompt = the chat template over the turns before the last assistant turn
                                     (a trailing assistant turn, if any, is dropped), with the generation prompt
  {"prompt": str}                    one user turn, chat-templated the same way
  {"input_ids": [...]} (+ loss_mask) raw prompt token ids; with a loss_mask, only the tokens before its first 1
Output rows, one JSON object per line in the order they finish: {"id", "input_ids", "loss_mask", "response_text",
"finish_reason"}, id = the input row's line (or row) index, loss_mask 1 exactly on the generated tokens (the stop
token included when one ended the response). A "stage" field of the input is carried over.

Scale: the input is read as it is consumed (never held whole), each row is written and flushed as it finishes, and a
re-run with the same output skips the ids already there (a crash, kill -9 included, loses at most the rows in
flight; a torn last line is cut off). backend=vllm (the default where vLLM is installed; `auto` says so when it
falls back) keeps one engine busy with continuous batching; backend=hf runs transformers in left-padded batches
(one row at a time for recurrent hybrids: slow on long prompts).

Stops: the tokenizer's eos and "<|im_end|>" when the vocabulary has them, plus `stop` (token strings). A prompt
with no room left in the target's context (prompt tokens >= max_position_embeddings) is skipped, counted and named
(row, tokens, context); responses are capped to fit the context.
"""

import json
import logging
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from specdistill.data.formats import END_OF_TURN, Where, chunks, read_chunk
from specdistill.data.generate import GenerationSettings, Request, VLLMGenerator, generate, resolve_backend

log = logging.getLogger("specdistill.regenerate")
HF_WINDOW = 16  # batches of prompts the hf backend reads ahead (sorted by length inside the window)
_ID_PREFIX = re.compile(rb'^\{"id": (\d+),')


@dataclass
class RegenerateSettings:
    input: str = "???"
    output: str = "???"
    backend: str = "auto"  # auto (vllm where installed) | vllm | hf
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    stop: list[str] = field(default_factory=list)
    batch_size: int = 32  # hf: prompts per batch
    seed: int = 0
    dtype: str | None = None  # None: the checkpoint's own


@dataclass
class Prompt:
    row_id: int
    ids: list[int]
    stage: str | None = None


def iter_prompts(path: Path, tokenizer) -> Iterator[Prompt]:
    """The prompts of `path`, read as consumed (JSONL, Parquet or Arrow: specdistill/data/formats.py)."""
    for chunk in chunks(path):
        for row_id, obj, at in read_chunk(chunk):
            stage = obj.get("stage") if isinstance(obj, dict) and isinstance(obj.get("stage"), str) else None
            yield Prompt(row_id, _prompt_ids(obj, tokenizer, at), stage)


def read_prompts(path: Path, tokenizer) -> list[Prompt]:
    prompts = list(iter_prompts(Path(path), tokenizer))
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


def _prompt_ids(obj, tokenizer, at: Where) -> list[int]:
    where = at.place
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object")
    if obj.get("input_ids") is not None:
        ids, mask = obj["input_ids"], obj.get("loss_mask")
        if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids) or not ids:
            raise ValueError(f"{where}, field 'input_ids': expected a non-empty list of ints")
        if mask is not None:
            ids = ids[: mask.index(1)] if 1 in mask else ids
        return ids
    if obj.get("messages") is not None:
        turns = obj["messages"]
        if not isinstance(turns, list) or not turns or not all(isinstance(m, dict) and "role" in m for m in turns):
            raise ValueError(f"{where}, field 'messages': expected a list of {{role, content}} objects")
        if turns[-1]["role"] == "assistant":
            turns = turns[:-1]
        if not turns:
            raise ValueError(f"{where}, field 'messages': no turn before the assistant's")
    elif obj.get("prompt") is not None:
        if not isinstance(obj["prompt"], str):
            raise ValueError(f"{where}, field 'prompt': expected a string")
        turns = [{"role": "user", "content": obj["prompt"]}]
    else:
        raise ValueError(f"{where}: expected one of the fields messages, prompt, input_ids; got {sorted(obj)}")
    text = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def stop_token_ids(tokenizer, extra: list[str]) -> list[int]:
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    vocab = tokenizer.get_vocab()
    if END_OF_TURN in vocab:
        ids.add(vocab[END_OF_TURN])
    for token in extra:
        if token not in vocab:
            raise ValueError(f"stop={token!r} is not a token of the target's tokenizer")
        ids.add(vocab[token])
    return sorted(ids)


def written_ids(path: Path) -> set[int]:
    """Ids of the complete rows an earlier run wrote to `path`; a torn last line (a crash mid-write) is cut off.
    Reads only each line's `{"id": N,` prefix and its end, so a multi-GB output is checked at disk speed."""
    if not path.is_file():
        return set()
    ids, good_end = set(), 0
    with path.open("rb") as f:
        for line in f:
            m = _ID_PREFIX.match(line)
            if not (m and line.endswith(b"}\n")):
                break
            ids.add(int(m.group(1)))
            good_end += len(line)
    if good_end < path.stat().st_size:
        log.warning("%s: cutting a torn last row at byte %d (a run stopped mid-write)", path, good_end)
        os.truncate(path, good_end)
    return ids


class _Writer:
    """Appends one output row per finished response, flushed at once (a kill -9 loses nothing written)."""

    def __init__(self, path: Path, tokenizer, stop_ids: list[int]):
        path.parent.mkdir(parents=True, exist_ok=True)
        self._f, self._tok, self._stops = path.open("a"), tokenizer, set(stop_ids)
        self.rows, self.response_tokens = 0, 0
        self.started, self.first_row_at = time.perf_counter(), None

    def write(self, prompt: Prompt, response: list[int]) -> None:
        reason = "stop" if response and response[-1] in self._stops else "length"
        row = {"id": prompt.row_id, "input_ids": prompt.ids + response,
               "loss_mask": [0] * len(prompt.ids) + [1] * len(response),
               "response_text": self._tok.decode(response), "finish_reason": reason}
        if prompt.stage is not None:
            row["stage"] = prompt.stage
        self._f.write(json.dumps(row) + "\n")
        self._f.flush()
        if self.first_row_at is None:
            self.first_row_at = time.perf_counter()
        self.rows += 1
        self.response_tokens += len(response)

    def close(self) -> None:
        self._f.close()


def regenerate(target_dir: Path, cfg: RegenerateSettings) -> dict:
    from transformers import AutoConfig, AutoTokenizer

    backend = resolve_backend(cfg.backend)
    tokenizer = AutoTokenizer.from_pretrained(str(target_dir), local_files_only=True)
    context = AutoConfig.from_pretrained(str(target_dir)).get_text_config().max_position_embeddings
    stop_ids = stop_token_ids(tokenizer, list(cfg.stop))
    settings = GenerationSettings(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
                                  batch_size=cfg.batch_size, seed=cfg.seed)
    out_path = Path(cfg.output)
    done = written_ids(out_path)
    if done:
        log.info("%s: %d rows already written; resuming after them", out_path, len(done))
    counts = {"seen": 0, "resumed": 0, "too_long": []}

    def todo() -> Iterator[Prompt]:
        for p in iter_prompts(Path(cfg.input), tokenizer):
            counts["seen"] += 1
            if p.row_id in done:
                counts["resumed"] += 1
            elif len(p.ids) >= context:
                counts["too_long"].append(p.row_id)
                log.warning("%s, row %d: %d prompt tokens leave no room in the target's %d-token context "
                            "(max_position_embeddings); skipped", cfg.input, p.row_id, len(p.ids), context)
            else:
                yield p

    writer, t0 = _Writer(out_path, tokenizer, stop_ids), time.perf_counter()
    try:
        if backend == "vllm":
            _run_vllm(target_dir, todo(), settings, stop_ids, context, cfg, writer)
        else:
            _run_hf(target_dir, todo(), settings, stop_ids, context, cfg, writer)
    finally:
        writer.close()
    if counts["seen"] == 0:
        raise ValueError(f"{cfg.input}: no prompts")
    if counts["seen"] == len(counts["too_long"]):
        raise ValueError(f"{cfg.input}: every prompt is longer than the target's context ({context} tokens)")
    seconds = time.perf_counter() - t0
    # After the first row: the generation rate without the model load / engine start.
    first = (writer.first_row_at or time.perf_counter()) - writer.started
    summary = {"backend": backend, "rows_written": writer.rows, "rows_already_written": counts["resumed"],
               "rows_skipped_too_long": len(counts["too_long"]), "output": str(out_path),
               "seconds": round(seconds, 1), "rows_per_s": round(writer.rows / max(seconds, 1e-9), 2),
               "first_row_seconds": round(first, 1),
               "rows_per_s_after_first": round((writer.rows - 1) / max(seconds - first, 1e-9), 2),
               "response_tokens": writer.response_tokens}
    log.info("regenerate: %s", json.dumps(summary))
    return summary


def _run_vllm(target_dir, prompts: Iterator[Prompt], settings, stop_ids, context: int, cfg, writer: _Writer) -> None:
    by_key: dict[int, Prompt] = {}

    def requests():
        for p in prompts:
            by_key[p.row_id] = p
            yield Request(p.row_id, p.ids, min(settings.max_new_tokens, context - len(p.ids)), p.row_id)

    with VLLMGenerator(target_dir, cfg.dtype, settings.seed, max_model_len=context) as engine:
        for key, response in engine.stream(requests(), settings, stop_ids):
            writer.write(by_key.pop(key), response)


def _run_hf(target_dir, prompts: Iterator[Prompt], settings, stop_ids, context: int, cfg, writer: _Writer) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(target_dir), local_files_only=True, dtype="auto" if cfg.dtype is None else getattr(torch, cfg.dtype)).eval()
    pad = model.config.pad_token_id or 0
    window: list[Prompt] = []
    for p in prompts:
        window.append(p)
        if len(window) == settings.batch_size * HF_WINDOW:
            _hf_window(model, window, settings, stop_ids, context, pad, writer)
            window = []
    _hf_window(model, window, settings, stop_ids, context, pad, writer)


def _hf_window(model, window: list[Prompt], settings, stop_ids, context: int, pad: int, writer: _Writer) -> None:
    """One window of prompts, by response cap (prompts near the context get less room), written batch by batch."""
    from dataclasses import replace

    caps = [min(settings.max_new_tokens, context - len(p.ids)) for p in window]
    for cap in sorted(set(caps)):
        group = [p for p, c in zip(window, caps) if c == cap]
        seeded = replace(settings, max_new_tokens=cap, seed=settings.seed)
        for start in range(0, len(group), settings.batch_size):
            batch = group[start:start + settings.batch_size]
            # seeds by row id (as the vllm path), so a sampled row does not depend on its neighbours
            responses = generate(model, [p.ids for p in batch], seeded, pad, stop_ids,
                                 seeds=[p.row_id for p in batch])
            for p, r in zip(batch, responses):
                writer.write(p, r)
