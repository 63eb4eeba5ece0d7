"""Replay synthetic workload prompts through a target and write the pre-tokenized train / heldout sets.

    specdistill-make-workload --target DIR --out DIR --rows N --heldout M \
        [--max-new-tokens 48] [--prompt-tokens 400] [--prompt-spread 0] [--backend auto] [--seed 0]

The responses are the target's own greedy continuations (the drafter learns the target, not the template), from
specdistill/data/generate.py: vLLM's continuous batching where it is installed (backend=auto), else transformers (batched for
dense targets; one row at a time for hybrid ones, whose DeltaNet state left padding would corrupt). A prompt is the
target's chat template over the turns before the response, with `chat_template_kwargs` (data.chat_template_kwargs),
as a chat server renders it; generation stops at the target's stop tokens (specdistill/data/chat.py: its eos,
generation_config.json's, its template's end of turn). Output rows: {"id", "stage", "input_ids", "loss_mask",
"prompt_text", "response_text"}; loss_mask is 1 exactly on the generated tokens, the stop token included when the
target emitted one.
"""

import json
import os
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm
from specdistill.data.chat import ChatFormat
from specdistill.data.generate import GenerationSettings, resolve_backend, respond
from specdistill.data.workload import DEFAULT_PROMPT_TOKENS, generate_rows


def _write_jsonl(rows: list[dict], path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    os.replace(tmp, path)  # atomic: readers see the old file or the whole new one


def _replay(target_dir, chat, rows: list[dict], max_new_tokens: int, backend: str, desc: str) -> list[dict]:
    """`chat`: the target's ChatFormat (or its tokenizer: template defaults, no generation_config.json eos)."""
    chat = chat if isinstance(chat, ChatFormat) else ChatFormat(chat)
    tokenizer = chat.tokenizer
    prompt_texts = [chat.prompt_text(r["messages"][:-1]) for r in rows]
    prompts = [chat.encode(t) for t in prompt_texts]
    with tqdm(total=len(rows), desc=f"{desc} ({backend})", unit="row") as bar:
        responses = respond(target_dir, prompts, GenerationSettings(max_new_tokens=max_new_tokens),
                            sorted(chat.stop_ids), backend, progress=bar.update)
    return [{"id": row["id"], "stage": row["stage"], "input_ids": p + r, "loss_mask": [0] * len(p) + [1] * len(r),
             "prompt_text": text, "response_text": tokenizer.decode(r, skip_special_tokens=True)}
            for row, text, p, r in zip(rows, prompt_texts, prompts, responses)]


def make_workload(
    target_dir: str | Path,
    out_dir: str | Path,
    rows: int,
    heldout: int,
    max_new_tokens: int = 48,
    prompt_tokens: int = DEFAULT_PROMPT_TOKENS,
    seed: int = 0,
    backend: str = "auto",
    prompt_spread: float = 0.0,
    chat_template_kwargs: dict | None = None,
) -> tuple[Path, Path]:
    """Write out_dir/train.jsonl (`rows` rows) and out_dir/heldout.jsonl (`heldout` rows, other sessions)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    backend = resolve_backend(backend)
    chat = ChatFormat.load(target_dir, chat_template_kwargs)
    tokenizer = chat.tokenizer

    def count_tokens(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    # Decode steps of a tiny model are too small to share across threads: on a busy 2-core machine one thread
    # generated a row in ~1.5 s, two threads in ~25 s (transformers; a vLLM engine sets its own threads).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    paths, t0 = [], time.perf_counter()
    try:
        for split, n in (("train", rows), ("heldout", heldout)):
            prompts = generate_rows(n, seed=seed, split=split, prompt_tokens=prompt_tokens, count_tokens=count_tokens,
                                    prompt_spread=prompt_spread)
            path = out_dir / f"{split}.jsonl"
            _write_jsonl(_replay(target_dir, chat, prompts, max_new_tokens, backend, desc=split), path)
            paths.append(path)
    finally:
        torch.set_num_threads(threads)
    elapsed = time.perf_counter() - t0
    meta = {"target": str(target_dir), "rows": rows, "heldout": heldout, "max_new_tokens": max_new_tokens,
            "prompt_tokens": prompt_tokens, "prompt_spread": prompt_spread, "seed": seed, "backend": backend,
            "chat_template_kwargs": chat.kwargs, "stop_token_ids": sorted(chat.stop_ids),
            "seconds": round(elapsed, 2), "rows_per_s": round((rows + heldout) / max(elapsed, 1e-9), 3),
            "argv": sys.argv, "torch": torch.__version__}
    (out_dir / "workload_meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return paths[0], paths[1]
