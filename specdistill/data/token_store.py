"""The tokenized dataset, built once per node and memory-mapped by every process that reads it.

Layout (Megatron's indexed dataset and nanoGPT's .bin, in numpy): one directory per (input file content, tokenizer,
chat template, store version) under `<cache_dir>/tokens/<key>/`:
  tokens.u32     every kept row's token ids end to end (uint32: vocabularies pass 65,535)
  loss_mask.u8   one byte per token, 1 on response tokens
  offsets.npy    [N+1] int64: row i is tokens[offsets[i]:offsets[i+1]]
  row_ids.npy    [N] int64: the row's line (JSONL) or row (Parquet/Arrow) index in the input file
  first_loss.npy [N] int32: where the row's response starts (its first loss_mask 1), for truncation
  stages.npy     [N] int16 codes into meta.json "stages" (-1: the row has none)
  meta.json      the build's report (rows seen, skipped, tokens) and settings; written last, so a directory with it
                 is complete (a build goes to a temporary directory renamed into place)
A reader maps the two token files (np.memmap: the page cache is shared by every rank and feature worker of the
node, and pages come and go with use) and loads the index (24 bytes a row); it never holds rows as Python objects.
Why numpy and not Hugging Face datasets/Arrow: docs/data.md "The token store".

The first start tokenizes the file in parallel over the node's cores (`workers` processes, one chunk each at a
time: specdistill/data/formats.py), with a progress bar; later starts, other ranks and resumes find the directory and map it.
The key hashes the file's bytes (memoised per (device, inode, size, mtime, ctime), so a restart does not re-read a
multi-GB file; any write to a file changes its ctime), the tokenizer's files and chat template, and the format
version: a cache built from another file, another tokenizer or another template is never reused. What depends on
the run's settings (the pack size, truncation) is applied when the store is read (specdistill/data/selection.py), so one
tokenization serves every pack size.
"""

import copy
import hashlib
import json
import logging
import multiprocessing as mp
import os
import shutil
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from specdistill.core.build_lock import build_lock
from specdistill.core.contract import TokenizedRow
from specdistill.core.rows import Rows
from specdistill.data.formats import END_OF_TURN, Chunk, DatasetError, SkipReport, Where, check_vocab, chunks, parse_row, \
    read_chunk, row_stage

log = logging.getLogger(__name__)

STORE_VERSION = 1  # bump when the layout or the parsing changes: old caches are then never read
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json")
_COPY_BYTES = 64 << 20


# ---- the key --------------------------------------------------------------------------------------------------
def content_digest(path: Path, memo_dir: Path) -> str:
    """sha256 of the file's bytes, memoised by its (device, inode, size, mtime_ns, ctime_ns): a rewrite changes
    ctime (which no tool can set back), so a memo hit means the same bytes."""
    st = os.stat(path)
    stamp = [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]
    memo = memo_dir / (hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:24] + ".json")
    try:
        saved = json.loads(memo.read_text())
        if saved["stamp"] == stamp:
            return saved["sha256"]
    except (OSError, ValueError, KeyError):
        pass
    with path.open("rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    memo_dir.mkdir(parents=True, exist_ok=True)
    tmp = memo.with_name(f".{memo.name}.{os.getpid()}")
    tmp.write_text(json.dumps({"path": str(path.resolve()), "stamp": stamp, "sha256": digest}))
    os.replace(tmp, memo)
    return digest


def tokenizer_digest(tokenizer_dir: Path) -> str:
    """sha256 over the tokenizer's files (vocabulary, merges, special tokens, chat template) in the directory."""
    h = hashlib.sha256()
    found = [name for name in TOKENIZER_FILES if (tokenizer_dir / name).is_file()]
    if not found:
        raise FileNotFoundError(f"{tokenizer_dir}: no tokenizer files ({', '.join(TOKENIZER_FILES[:2])}, ...)")
    for name in found:
        h.update(name.encode() + b"\0" + (tokenizer_dir / name).read_bytes() + b"\0")
    return h.hexdigest()


def store_key(path: Path, tokenizer_dir: Path, cache_dir: Path) -> str:
    parts = [f"v{STORE_VERSION}", END_OF_TURN, content_digest(path, cache_dir / "tokens" / "digests"),
             tokenizer_digest(tokenizer_dir)]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:20]


# ---- reading --------------------------------------------------------------------------------------------------
class TokenStore:
    """A built store, mapped read-only. `rows()` is the whole of it as a Rows view."""

    def __init__(self, directory: Path):
        self.dir = Path(directory)
        self.meta = json.loads((self.dir / "meta.json").read_text())
        self.offsets = np.load(self.dir / "offsets.npy")
        self.row_ids = np.load(self.dir / "row_ids.npy")
        self.first_loss = np.load(self.dir / "first_loss.npy")
        self.stage_codes = np.load(self.dir / "stages.npy")
        self.stage_names: list[str] = self.meta["stages"]
        total = int(self.offsets[-1])
        self.tokens = _map(self.dir / "tokens.u32", np.uint32, total)
        self.loss_mask = _map(self.dir / "loss_mask.u8", np.uint8, total)

    @property
    def source(self) -> str:
        return self.meta["source"]

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def build_report(self) -> SkipReport:
        """A fresh copy of what the build skipped (callers add their own skips to it)."""
        return SkipReport(**copy.deepcopy(self.meta["report"]))

    def __len__(self) -> int:
        return len(self.row_ids)

    def row(self, position: int, start: int = 0) -> TokenizedRow:
        """Row `position`, its first `start` tokens cut off (left truncation)."""
        a, b = int(self.offsets[position]) + start, int(self.offsets[position + 1])
        return TokenizedRow(int(self.row_ids[position]), tuple(self.tokens[a:b].tolist()),
                            tuple(self.loss_mask[a:b].tolist()))

    def rows(self) -> "StoreRows":
        return StoreRows(self, np.arange(len(self), dtype=np.int64))

    def stages_by_row_id(self) -> dict[int, str]:
        return {int(r): self.stage_names[c] for r, c in zip(self.row_ids, self.stage_codes) if c >= 0}


def _map(path: Path, dtype, count: int) -> np.ndarray:
    if count == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", shape=(count,))


class StoreRows(Rows):
    """Rows of a TokenStore by position, each optionally cut on the left (`starts`): an index, not rows."""

    def __init__(self, store: TokenStore, positions: np.ndarray, starts: np.ndarray | None = None):
        self.store, self.positions = store, np.asarray(positions, dtype=np.int64)
        self.starts = np.zeros(len(self.positions), dtype=np.int32) if starts is None else np.asarray(starts, np.int32)
        self.row_ids = store.row_ids[self.positions]
        self.num_tokens = store.lengths[self.positions] - self.starts

    def _row(self, i: int) -> TokenizedRow:
        return self.store.row(int(self.positions[i]), int(self.starts[i]))

    def take(self, positions: np.ndarray) -> "StoreRows":
        positions = np.asarray(positions, dtype=np.int64)
        return StoreRows(self.store, self.positions[positions], self.starts[positions])

    def response_tokens(self) -> np.ndarray:
        """Per row, summed on the memory-mapped mask (no row is built)."""
        s, out = self.store, np.zeros(len(self), dtype=np.int64)
        for i, (p, cut) in enumerate(zip(self.positions, self.starts)):
            out[i] = int(s.loss_mask[s.offsets[p] + cut:s.offsets[p + 1]].sum())
        return out

    def response_token_counts(self, vocab_size: int) -> np.ndarray:
        """Vectorised over blocks of rows: one bincount per block, not per row."""
        counts = np.zeros(vocab_size, dtype=np.int64)
        s = self.store
        for lo in range(0, len(self), 4096):
            pos, cut = self.positions[lo:lo + 4096], self.starts[lo:lo + 4096]
            spans = [np.arange(s.offsets[p] + c, s.offsets[p + 1]) for p, c in zip(pos, cut)]
            if not spans:
                continue
            idx = np.concatenate(spans)
            ids = s.tokens[idx][s.loss_mask[idx].astype(bool)].astype(np.int64)
            counts += np.bincount(ids, minlength=vocab_size)[:vocab_size]
        return counts


# ---- building -------------------------------------------------------------------------------------------------
def open_store(path: str | Path, tokenizer_dir: str | Path, cache_dir: str | Path, workers: int | None = None,
               progress: bool = True) -> TokenStore:
    """The store of `path` tokenized with the tokenizer in `tokenizer_dir`: found in the cache, or built once
    (concurrent callers wait for one builder)."""
    path, tokenizer_dir, cache_dir = Path(path), Path(tokenizer_dir), Path(cache_dir)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such data file")
    t0 = time.perf_counter()
    final = cache_dir / "tokens" / store_key(path, tokenizer_dir, cache_dir)
    if not (final / "meta.json").is_file():
        with build_lock(final):
            if not (final / "meta.json").is_file():
                _build(path, tokenizer_dir, final, workers or _cores(), progress)
    store = TokenStore(final)
    log.info("%s: %d rows, %d tokens, token store %s (%.2f s)", path, len(store), int(store.offsets[-1]), final,
             time.perf_counter() - t0)
    return store


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _build(path: Path, tokenizer_dir: Path, final: Path, workers: int, progress: bool) -> None:
    from tqdm import tqdm

    pieces = chunks(path)
    tmp = final.with_name(f".{final.name}.building-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "parts").mkdir(parents=True)
    t0 = time.perf_counter()
    tasks = [(k, c, str(tmp / "parts"), str(tokenizer_dir)) for k, c in enumerate(pieces)]
    procs = max(1, min(workers, len(tasks)))
    results, rows, tokens = {}, 0, 0
    bar = tqdm(total=sum(c.size for c in pieces), disable=not progress, unit="B" if pieces and
               pieces[0].kind == "jsonl" else "row", unit_scale=True, desc=f"tokenize {path.name} ({procs} proc)")
    try:
        for result in _run_tasks(tasks, procs, str(tokenizer_dir)):
            results[result["k"]] = result
            rows += len(result["row_ids"])
            tokens += result["tokens"]
            elapsed = max(time.perf_counter() - t0, 1e-9)
            bar.update(pieces[result["k"]].size)
            bar.set_postfix(rows_per_s=f"{rows / elapsed:,.0f}", tokens_per_s=f"{tokens / elapsed:,.0f}")
        bar.close()
        _assemble(path, tmp, [results[k] for k in range(len(tasks))], time.perf_counter() - t0, procs)
        if final.exists():  # an incomplete leftover (no meta.json) of a crashed build
            shutil.rmtree(final)
        os.rename(tmp, final)
    finally:
        bar.close()
        shutil.rmtree(tmp, ignore_errors=True)


def _run_tasks(tasks: list, procs: int, tokenizer_dir: str):
    """Chunk results as they finish: in this process for one worker (no start-up cost), else a spawned pool."""
    if procs == 1:
        _init_worker(tokenizer_dir)
        yield from map(_tokenize_chunk, tasks)
        return
    ctx = mp.get_context("spawn")  # the caller may hold threads (torch); fork would copy their locks
    with ctx.Pool(procs, initializer=_init_worker, initargs=(tokenizer_dir,)) as pool:
        yield from pool.imap_unordered(_tokenize_chunk, tasks)


def _assemble(path: Path, tmp: Path, results: list[dict], seconds: float, procs: int) -> None:
    """Concatenate the chunks' part files into the two token files and write the index and meta.json."""
    for suffix in ("tokens.u32", "loss_mask.u8"):
        with open(tmp / suffix, "wb") as out:
            for r in results:
                part = Path(r["parts"][suffix])
                with open(part, "rb") as f:
                    _copy(f, out)
                part.unlink()
    lengths = np.concatenate([r["lengths"] for r in results]) if results else np.zeros(0, np.int64)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    stage_names = sorted({s for r in results for s in r["stages"] if s is not None})
    code = {s: i for i, s in enumerate(stage_names)}
    stages = np.array([code[s] if s is not None else -1 for r in results for s in r["stages"]], dtype=np.int16)
    np.save(tmp / "offsets.npy", offsets)
    np.save(tmp / "row_ids.npy", np.concatenate([r["row_ids"] for r in results]) if results else np.zeros(0, np.int64))
    np.save(tmp / "first_loss.npy", np.concatenate([r["first_loss"] for r in results]) if results else
            np.zeros(0, np.int32))
    np.save(tmp / "stages.npy", stages)
    report = SkipReport(str(path))
    for r in results:
        report.merge(r["report"])
    meta = {"version": STORE_VERSION, "source": str(path), "rows": len(lengths), "tokens": int(offsets[-1]),
            "response_tokens": int(sum(r["response_tokens"] for r in results)), "stages": stage_names,
            "report": asdict(report), "build_seconds": round(seconds, 3), "build_processes": procs,
            "tokens_per_s": round(int(offsets[-1]) / max(seconds, 1e-9))}
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    shutil.rmtree(tmp / "parts", ignore_errors=True)


def _copy(src, dst) -> None:
    try:
        while os.copy_file_range(src.fileno(), dst.fileno(), _COPY_BYTES):
            pass
    except OSError:  # filesystems without copy_file_range
        shutil.copyfileobj(src, dst, _COPY_BYTES)


# ---- one chunk, in a worker process ---------------------------------------------------------------------------
_TOKENIZER = None


def _init_worker(tokenizer_dir: str) -> None:
    global _TOKENIZER
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one process per core already
    from transformers import AutoTokenizer

    _TOKENIZER = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)


class _ChunkWriter:
    """Accumulates one chunk's rows, then writes its two part files."""

    def __init__(self, path: str):
        self.report = SkipReport(path)
        self.ids: list[np.ndarray] = []
        self.masks: list[np.ndarray] = []
        self.row_ids: list[int] = []
        self.first_loss: list[int] = []
        self.stages: list[str | None] = []

    def add(self, row_id: int, ids: np.ndarray, mask: np.ndarray, stage: str | None) -> None:
        self.ids.append(ids.astype(np.uint32))
        self.masks.append(mask.astype(np.uint8))
        self.row_ids.append(row_id)
        self.first_loss.append(int(np.argmax(mask)))
        self.stages.append(stage)

    def finish(self, k: int, parts_dir: str) -> dict:
        self.report.rows_kept = len(self.row_ids)
        files = {"tokens.u32": f"{parts_dir}/{k}.tokens.u32", "loss_mask.u8": f"{parts_dir}/{k}.loss_mask.u8"}
        ids = np.concatenate(self.ids) if self.ids else np.zeros(0, np.uint32)
        mask = np.concatenate(self.masks) if self.masks else np.zeros(0, np.uint8)
        ids.tofile(files["tokens.u32"])
        mask.tofile(files["loss_mask.u8"])
        return {"k": k, "parts": files, "report": self.report, "tokens": len(ids), "response_tokens": int(mask.sum()),
                "lengths": np.array([len(a) for a in self.ids], dtype=np.int64),
                "row_ids": np.array(self.row_ids, dtype=np.int64),
                "first_loss": np.array(self.first_loss, dtype=np.int32), "stages": self.stages}


def _tokenize_chunk(task) -> dict:
    k, chunk, parts_dir, _ = task
    vocab = len(_TOKENIZER)
    out = _ChunkWriter(chunk.path)
    if chunk.kind != "jsonl" and _add_pretokenized_tables(chunk, out, vocab):
        return out.finish(k, parts_dir)
    for row_id, obj, at in read_chunk(chunk):
        out.report.rows_seen += 1
        parsed = parse_row(_TOKENIZER, obj, at)
        if parsed is None:
            out.report.skip("no_response_tokens", row_id)
            continue
        ids, mask = np.asarray(parsed[0], dtype=np.int64), np.asarray(parsed[1], dtype=np.uint8)
        if len(ids) and (ids.min() < 0 or ids.max() >= vocab):
            check_vocab(parsed[0], vocab, at)
        out.add(row_id, ids, mask, row_stage(obj, at))
    return out.finish(k, parts_dir)


def _add_pretokenized_tables(chunk: Chunk, out: _ChunkWriter, vocab: int) -> bool:
    """Pre-tokenized Parquet/Arrow rows, vectorised (no Python object per token). False when the chunk is not
    plainly pre-tokenized (other formats, nulls, non-integer lists): the per-row path then reads it and names any
    bad row."""
    import pyarrow as pa

    from specdistill.data.formats import _tables

    tables = list(_tables(chunk))
    for table in tables:
        names = set(table.column_names)
        if not {"input_ids", "loss_mask"} <= names or names & {"messages", "prompt", "response"}:
            return False
        for name in ("input_ids", "loss_mask"):
            col = table.column(name)
            if col.null_count or not (pa.types.is_list(col.type) or pa.types.is_large_list(col.type)) or \
                    not pa.types.is_integer(col.type.value_type):
                return False
    first = chunk.first_row
    for table in tables:
        ids_col, mask_col = (_one_array(table.column(name)) for name in ("input_ids", "loss_mask"))
        offsets = ids_col.offsets.to_numpy().astype(np.int64)
        ids = ids_col.values.to_numpy(zero_copy_only=False).astype(np.int64)
        mask = mask_col.values.to_numpy(zero_copy_only=False)
        mask_offsets = mask_col.offsets.to_numpy().astype(np.int64)
        n = len(offsets) - 1
        stages = table.column("stage").to_pylist() if "stage" in table.column_names else [None] * n
        _check_pretokenized(chunk, first, offsets, mask_offsets, ids, mask, vocab)
        for i in range(n):
            row_id = first + i
            a, b = offsets[i], offsets[i + 1]
            out.report.rows_seen += 1
            if b == a or not mask[a:b].any():
                out.report.skip("no_response_tokens", row_id)
                continue
            stage = stages[i]
            if stage is not None and not isinstance(stage, str):
                raise Where(Path(chunk.path), row_id, "row").error("stage", "a string", stage)
            out.add(row_id, ids[a:b], mask[a:b], stage)
        first += n
    return True


def _one_array(column):
    """A table's column as one Arrow array (a Parquet table's columns are chunked, a record batch's are not)."""
    return column.combine_chunks() if hasattr(column, "combine_chunks") else column


def _check_pretokenized(chunk: Chunk, first: int, offsets, mask_offsets, ids, mask, vocab: int) -> None:
    def where(flat_index=None, row=None) -> Where:
        if row is None:
            row = int(np.searchsorted(offsets, flat_index, side="right") - 1)
        return Where(Path(chunk.path), first + row, "row")

    if not np.array_equal(offsets, mask_offsets):
        row = int(np.flatnonzero(np.diff(offsets) != np.diff(mask_offsets))[0])
        raise where(row=row).error("loss_mask", f"the same length as input_ids ({offsets[row + 1] - offsets[row]})"
                                   f", got length {mask_offsets[row + 1] - mask_offsets[row]}")
    bad = np.flatnonzero((mask != 0) & (mask != 1))
    if len(bad):
        raise where(bad[0]).error("loss_mask", "a list of 0/1", int(mask[bad[0]]))
    bad = np.flatnonzero((ids < 0) | (ids >= vocab))
    if len(bad):
        raise DatasetError(f"{where(bad[0]).place}: token id {int(ids[bad[0]])} outside the tokenizer's vocab "
                           f"[0, {vocab}): tokenizer does not match the target's vocab (was this file tokenized "
                           "for another target?)")
