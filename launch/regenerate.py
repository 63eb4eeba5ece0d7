"""Your prompts, the target's answers: rows ready for `data=jsonl`.

    python -m launch.regenerate target.path=DIR input=prompts.jsonl output=train.jsonl \
        [backend=hf|vllm] [max_new_tokens=256] [temperature=0] [top_p=1] [stop=[...]] [batch_size=32] [seed=0]

A drafter must learn the target's outputs, not the dataset's: whatever wrote the responses in your file, this
replaces them by the target's own (greedy by default). Input rows (JSONL, any mix):
  {"messages": [...]}                prompt = the chat template over the turns before the last assistant turn
                                     (a trailing assistant turn, if any, is dropped), with the generation prompt
  {"prompt": str}                    one user turn, chat-templated the same way
  {"input_ids": [...]} (+ loss_mask) raw prompt token ids; with a loss_mask, only the tokens before its first 1
Output rows: {"id", "input_ids", "loss_mask", "response_text", "finish_reason"} with loss_mask 1 exactly on the
generated tokens (the stop token included when one ended the response).

Stops: the tokenizer's eos and "<|im_end|>" when the vocabulary has them, plus `stop` (token strings). A prompt
with no room left in the target's context (prompt tokens >= max_position_embeddings) is skipped, counted and named
(row, tokens, context); responses are capped to fit the context. backend=vllm runs the engine batched (continuous
batching), backend=hf uses launch/generate.py (left-padded batches; one row per batch for recurrent hybrids).
"""

import json
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import OmegaConf

from launch.config import TargetConfig
from launch.generate import BACKENDS, GenerationSettings, respond

log = logging.getLogger("specdistill.regenerate")
END_OF_TURN = "<|im_end|>"


@dataclass
class RegenerateConfig:
    target: TargetConfig = field(default_factory=TargetConfig)
    input: str = "???"
    output: str = "???"
    backend: str = "hf"
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    stop: list[str] = field(default_factory=list)
    batch_size: int = 32
    seed: int = 0
    dtype: str | None = None  # None: the checkpoint's own
    cache_dir: str = ".cache/specdistill"


@dataclass
class Prompt:
    row_id: int
    ids: list[int]


def read_prompts(path: Path, tokenizer) -> list[Prompt]:
    prompts = []
    with path.open() as f:
        for row_id, line in enumerate(f):
            if not line.strip():
                continue
            where = f"{path}, line {row_id + 1} (row {row_id})"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: malformed JSON ({e.msg}); expected one JSON object per line") from None
            prompts.append(Prompt(row_id, _prompt_ids(obj, tokenizer, where)))
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


def _prompt_ids(obj, tokenizer, where: str) -> list[int]:
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object")
    if "input_ids" in obj:
        ids, mask = obj["input_ids"], obj.get("loss_mask")
        if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids) or not ids:
            raise ValueError(f"{where}, field 'input_ids': expected a non-empty list of ints")
        if mask is not None:
            ids = ids[: mask.index(1)] if 1 in mask else ids
        return ids
    if "messages" in obj:
        turns = obj["messages"]
        if not isinstance(turns, list) or not turns or not all(isinstance(m, dict) and "role" in m for m in turns):
            raise ValueError(f"{where}, field 'messages': expected a list of {{role, content}} objects")
        if turns[-1]["role"] == "assistant":
            turns = turns[:-1]
        if not turns:
            raise ValueError(f"{where}, field 'messages': no turn before the assistant's")
    elif "prompt" in obj:
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


def fit_to_context(prompts: list[Prompt], context: int, max_new_tokens: int) -> tuple[list[Prompt], list[int]]:
    """Prompts with at least one token of room; the ids of those skipped."""
    kept, skipped = [], []
    for p in prompts:
        if len(p.ids) < context:
            kept.append(p)
        else:
            skipped.append(p.row_id)
    return kept, skipped


def regenerate(cfg: RegenerateConfig) -> dict:
    from transformers import AutoConfig, AutoTokenizer
    from launch.prepare import resolve_target

    if cfg.backend not in BACKENDS:
        raise ValueError(f"backend={cfg.backend!r}; valid: {', '.join(BACKENDS)}")
    target_dir = resolve_target(cfg.target, Path(cfg.cache_dir))
    tokenizer = AutoTokenizer.from_pretrained(str(target_dir), local_files_only=True)
    context = AutoConfig.from_pretrained(str(target_dir)).get_text_config().max_position_embeddings
    stop_ids = stop_token_ids(tokenizer, list(cfg.stop))
    prompts, skipped = fit_to_context(read_prompts(Path(cfg.input), tokenizer), context, cfg.max_new_tokens)
    if skipped:
        log.warning("%d prompt(s) have >= %d tokens, the target's context (max_position_embeddings), and were "
                    "skipped: rows %s", len(skipped), context, skipped[:10])
    if not prompts:
        raise ValueError(f"{cfg.input}: every prompt is longer than the target's context ({context} tokens)")
    t0 = time.perf_counter()
    settings = GenerationSettings(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
                                  batch_size=cfg.batch_size, seed=cfg.seed)
    responses = respond(target_dir, [p.ids for p in prompts], settings, stop_ids, cfg.backend, context, cfg.dtype,
                        seeds=[p.row_id for p in prompts])
    results = sorted(zip(prompts, responses), key=lambda pr: pr[0].row_id)
    out_path = Path(cfg.output)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(f".{out_path.name}.tmp")
    stops = set(stop_ids)
    with tmp.open("w") as f:
        for p, response in results:
            reason = "stop" if response and response[-1] in stops else "length"
            f.write(json.dumps({"id": p.row_id, "input_ids": p.ids + response,
                                "loss_mask": [0] * len(p.ids) + [1] * len(response),
                                "response_text": tokenizer.decode(response), "finish_reason": reason}) + "\n")
    os.replace(tmp, out_path)
    summary = {"rows_written": len(results), "rows_skipped_too_long": len(skipped), "output": str(out_path),
               "seconds": round(time.perf_counter() - t0, 1),
               "response_tokens": sum(len(r) for _, r in results)}
    log.info("regenerate: %s", json.dumps(summary))
    return summary


def parse(argv: list[str]) -> RegenerateConfig:
    schema = OmegaConf.structured(RegenerateConfig)
    cfg = OmegaConf.merge(schema, OmegaConf.from_dotlist(argv))  # unknown keys fail here, naming the key
    for key in ("input", "output"):
        if OmegaConf.is_missing(cfg, key):
            raise SystemExit(f"launch.regenerate: {key}=FILE is required (usage: see the module docstring)")
    return OmegaConf.to_object(cfg)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    summary = regenerate(parse(sys.argv[1:] if argv is None else argv))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
