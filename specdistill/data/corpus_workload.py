"""Self-distilled train / held-out sets for a target pretrained on the corpus (specdistill/data/corpus.py): real text in,
the target's own greedy continuations out.

    specdistill-corpus-workload --target DIR --out DIR --rows 10000 --heldout 100 [--max-new-tokens 64]

A prompt is a window of a corpus file starting at a line: train rows come from the training files, held-out rows
from the held-out files (never seen in pretraining, nor by the drafter). The response is what the target generates
from it (specdistill/data/generate.py, batched) up to its stop tokens (specdistill/data/chat.py, the same as every other
generation's), so the drafter learns the target, not the text. Everything is a function of
(seed, split, index) and the target. Rows: {"id", "source", "input_ids", "loss_mask", "prompt_text",
"response_text"}, loss_mask 1 exactly on the generated tokens: ready for `data=jsonl`.
"""

import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm
from specdistill.data.chat import ChatFormat
from specdistill.data.corpus import CorpusFile, corpus_files, split
from specdistill.data.generate import GenerationSettings, resolve_backend, respond
from specdistill.data.synthetic import _write_jsonl


@dataclass(frozen=True)
class CorpusWorkload:
    rows: int = 2000
    heldout_rows: int = 64
    prompt_min_tokens: int = 96
    prompt_max_tokens: int = 320
    max_new_tokens: int = 64
    seed: int = 0
    batch_size: int = 32
    backend: str = "auto"  # auto (vllm where installed) | vllm | hf (specdistill/data/generate.py)


def sample_prompts(files: list[CorpusFile], tokenizer, n: int, lo: int, hi: int, rng: random.Random) -> list[dict]:
    """n prompts of lo..hi tokens, each a window of one file starting at a line; files drawn by their length."""
    weights = [len(f.text) for f in files]
    prompts = []
    while len(prompts) < n:
        f = rng.choices(files, weights)[0]
        starts = [0] + [i + 1 for i, c in enumerate(f.text) if c == "\n"]
        start = rng.choice(starts)
        want = rng.randint(lo, hi)
        ids = tokenizer(f.text[start:start + 8 * want], add_special_tokens=False)["input_ids"][:want]
        if len(ids) < lo:  # too near the end of the file
            continue
        prompts.append({"source": f"{f.relpath}:{f.text.count(chr(10), 0, start) + 1}", "prompt_ids": ids})
    return prompts


def write_parquet(rows: list[dict], path: Path, vocab_size: int) -> None:
    """Pre-tokenized rows as Parquet (zstd): ids in the narrowest integer type the vocabulary fits, the mask in int8,
    no text columns. 3,000 corpus rows are ~0.9 MB instead of ~9 MB of JSONL: small enough to commit."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    id_type = pa.int16() if vocab_size <= 2**15 else pa.int32()
    table = pa.table({"id": [r["id"] for r in rows], "source": [r["source"] for r in rows],
                      "input_ids": pa.array([r["input_ids"] for r in rows], pa.list_(id_type)),
                      "loss_mask": pa.array([r["loss_mask"] for r in rows], pa.list_(pa.int8()))})
    pq.write_table(table, path, compression="zstd")


def make_corpus_workload(target_dir: str | Path, out_dir: str | Path, cfg: CorpusWorkload = CorpusWorkload(),
                         threads: int | None = None, out_format: str = "jsonl") -> tuple[Path, Path]:
    """(train, held-out) files in out_dir, `{split}.jsonl` (with the texts) or `{split}.parquet` (ids only)."""
    if out_format not in ("jsonl", "parquet"):
        raise ValueError(f"out_format={out_format!r}: expected jsonl or parquet")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    backend = resolve_backend(cfg.backend)
    chat = ChatFormat.load(target_dir)  # raw text in, but the same stop tokens as every other generation
    tokenizer, stop_ids = chat.tokenizer, sorted(chat.stop_ids)
    settings = GenerationSettings(max_new_tokens=cfg.max_new_tokens, batch_size=cfg.batch_size, seed=cfg.seed)
    train_files, heldout_files = split(corpus_files())
    old_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    t0, paths = time.perf_counter(), []
    try:
        for name, files, n in (("train", train_files, cfg.rows), ("heldout", heldout_files, cfg.heldout_rows)):
            rng = random.Random(f"{cfg.seed}:{name}")
            prompts = sample_prompts(files, tokenizer, n, cfg.prompt_min_tokens, cfg.prompt_max_tokens, rng)
            with tqdm(total=n, desc=f"generate {name} ({backend})", unit="row") as bar:
                responses = respond(target_dir, [p["prompt_ids"] for p in prompts], settings, stop_ids, backend,
                                    progress=bar.update)
            rows = [{"id": f"{name}-{i}", "source": p["source"], "input_ids": p["prompt_ids"] + r,
                     "loss_mask": [0] * len(p["prompt_ids"]) + [1] * len(r),
                     "prompt_text": tokenizer.decode(p["prompt_ids"]), "response_text": tokenizer.decode(r)}
                    for i, (p, r) in enumerate(zip(prompts, responses))]
            path = out_dir / f"{name}.{out_format}"
            if out_format == "parquet":
                write_parquet(rows, path, len(tokenizer))
            else:
                _write_jsonl(rows, path)
            paths.append(path)
    finally:
        torch.set_num_threads(old_threads)
    meta = {"target": str(target_dir), **cfg.__dict__, "backend": backend, "seconds": round(time.perf_counter() - t0, 1),
            "argv": sys.argv, "torch": torch.__version__}
    (out_dir / "workload_meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return paths[0], paths[1]
