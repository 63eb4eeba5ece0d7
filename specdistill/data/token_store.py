"""The tokenized dataset, built once per node (or once per shared cache) and memory-mapped by every process that
reads it.

Layout (Megatron's indexed dataset and nanoGPT's .bin, in numpy): one directory per (input file content, tokenizer
files, chat template, generation_config.json, tokenization settings, transformers/tokenizers/jinja2 versions, store
version) under `<cache_dir>/tokens/<key>/`.
A row is one trained turn (a chat row with several assistant turns gives several, `data.loss_on=all`); its row id is
its position in the store (0..N-1, in file order, a conversation's turns in order): dense, unique, and stable for a
given key, with the input row and turn it came from recorded beside it:
  tokens.u32     every kept row's token ids end to end (uint32: vocabularies pass 65,535)
  loss_mask.u8   one byte per token, 1 on response tokens
  offsets.npy    [N+1] int64: row i is tokens[offsets[i]:offsets[i+1]]
  lines.npy      [N] int64: the input row it came from, its line (JSONL) or row (Parquet/Arrow) index in the file
  turns.npy      [N] int32: the trained assistant message's index in that row's messages (-1: pre-tokenized rows)
  first_loss.npy [N] int32: where the row's response starts (its first loss_mask 1), for truncation
  stages.npy     [N] int16 codes into meta.json "stages" (-1: the row has none)
  meta.json      the build's report (rows seen, skipped, tokens), settings and content_sha256 (the tokens, loss
                 mask and row bounds, hashed once here: one key can build other tokens, e.g. a template that renders
                 today's date; specdistill/trainer/consistency.py compares it between nodes); written last, so a
                 directory with it is complete (a build goes to a temporary directory renamed into place)
  counts/        added later, one file per selection of rows: response-token counts (EAGLE-3's draft vocabulary)
A reader maps the two token files (np.memmap: the page cache is shared by every rank and feature worker of the
node, and pages come and go with use) and loads the index (24 bytes a row); it never holds rows as Python objects.
Why numpy and not Hugging Face datasets/Arrow: docs/data.md "The token store".

The first start tokenizes the file in parallel over the node's cores (`workers` processes, one chunk each at a
time: specdistill/data/formats.py; a large Parquet row group is decoded once here and handed out in pieces), with a
progress bar; later starts, other ranks and resumes find the directory and map it.
The key hashes the file's bytes (memoised per path and (inode, size, mtime, ctime), which every NFS client of a
shared cache sees alike, so a restart on any node does not re-read a multi-GB file; any write to a file changes its
ctime), the tokenizer's files and chat template, generation_config.json (its eos ids end responses), every setting
that changes tokens (data.chat_template_kwargs, loss_on, bad_rows), the versions of the libraries that tokenize and
the format version: a cache built from another file, tokenizer, template, setting or library is never reused. What
depends on the run's settings (the pack size, truncation) is applied when the store is read
(specdistill/data/selection.py), so one tokenization serves every pack size.

On a shared cache (NFS, Lustre) builders on several nodes are safe: each builds into a temporary directory of its own
(host, pid, random), publishes it with one rename, keeps a complete store it finds in place (the loser reads the
winner's) and never removes one; the lock that makes the others wait falls back from flock to an owner file where
flock is unsupported (specdistill/core/build_lock.py).
"""

import copy
import hashlib
import json
import logging
import multiprocessing as mp
import os
import queue
import shutil
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from specdistill.core.build_lock import build_lock, dead_scratch, publish_dir, scratch_name
from specdistill.core.contract import TokenizedRow
from specdistill.core.rows import Rows
from specdistill.data.chat import ChatFormat, check_template_kwargs
from specdistill.data.config import DataConfig
from specdistill.data.formats import (Chunk, DatasetError, SkipReport, Where, check_settings, chunks, parse_chunk,
                                      tables, with_data)

log = logging.getLogger(__name__)

STORE_VERSION = 3  # bump when the layout or the parsing changes: old caches are then never read
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "spiece.model", "vocab.txt", "tekken.json",
                   "tiktoken.model", "chat_template.jinja", "chat_template.json", "generation_config.json")
# transformers also loads every template of additional_chat_templates/ (e.g. tool_use.jinja, used for rows with
# tools) and *.tiktoken vocabularies: globbed beside the files above.
TOKENIZER_GLOBS = ("additional_chat_templates/*.jinja", "*.tiktoken")
_COPY_BYTES = 64 << 20


# ---- the key --------------------------------------------------------------------------------------------------
def content_digest(path: Path, memo_dir: Path) -> str:
    """sha256 of the file's bytes, memoised by its path and (inode, size, mtime_ns, ctime_ns): a rewrite changes
    ctime (which no tool can set back), so a memo hit means the same bytes. No device number: it differs on every
    NFS client of one file (and between boots), while inode, size and times are the server's, so a memo on a shared
    cache holds on every node."""
    st = os.stat(path)
    stamp = [st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]
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
    tmp = scratch_name(memo, "tmp")  # host, pid and a random part: unique across the clients of a shared cache
    tmp.write_text(json.dumps({"path": str(path.resolve()), "stamp": stamp, "sha256": digest}))
    os.replace(tmp, memo)
    return digest


def tokenizer_digest(tokenizer_dir: Path) -> str:
    """sha256 over the tokenizer's files (vocabulary, merges, special tokens, chat templates, additional ones
    included) and generation_config.json (its eos ids are stop tokens) in the directory."""
    h = hashlib.sha256()
    found = [name for name in TOKENIZER_FILES if (tokenizer_dir / name).is_file()]
    found += sorted(str(p.relative_to(tokenizer_dir)) for pattern in TOKENIZER_GLOBS
                    for p in tokenizer_dir.glob(pattern) if p.is_file())
    if not found:
        raise FileNotFoundError(f"{tokenizer_dir}: no tokenizer files ({', '.join(TOKENIZER_FILES[:2])}, ...)")
    for name in found:
        h.update(name.encode() + b"\0" + (tokenizer_dir / name).read_bytes() + b"\0")
    return h.hexdigest()


def tokenize_settings(cfg: DataConfig) -> dict:
    """The data settings that change a store's tokens (its key and meta.json record them)."""
    return {"chat_template_kwargs": check_template_kwargs(cfg.chat_template_kwargs), "loss_on": cfg.loss_on,
            "bad_rows": cfg.bad_rows}


def library_versions() -> dict:
    """The libraries that turn text into tokens: another version may render a template or split a word otherwise,
    so each is part of the store key (and of the multi-node check, specdistill/trainer/consistency.py)."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("transformers", "tokenizers", "jinja2"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def store_key(path: Path, tokenizer_dir: Path, cache_dir: Path, cfg: DataConfig | None = None) -> str:
    settings = json.dumps(tokenize_settings(cfg or DataConfig()), sort_keys=True, default=str)
    parts = [f"v{STORE_VERSION}", settings, content_digest(path, cache_dir / "tokens" / "digests"),
             tokenizer_digest(Path(tokenizer_dir)), json.dumps(library_versions(), sort_keys=True)]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:20]


def is_complete(directory: Path) -> bool:
    """A store directory whose meta.json (written last, before the rename that publishes it) reads back: complete,
    and never removed or replaced by a builder."""
    try:
        return json.loads((Path(directory) / "meta.json").read_text()).get("version") == STORE_VERSION
    except (OSError, ValueError, AttributeError):
        return False


# ---- reading --------------------------------------------------------------------------------------------------
class TokenStore:
    """A built store, mapped read-only. `rows()` is the whole of it as a Rows view."""

    def __init__(self, directory: Path, source: str | Path | None = None):
        """source: the file this store is opened for. The store is keyed by content, so another file with the same
        bytes (another checkout's copy) shares it; reports and row locations name the caller's file, not the first
        builder's."""
        self.dir = Path(directory)
        self.meta = json.loads((self.dir / "meta.json").read_text())
        if source is not None:
            self.meta["source"] = str(source)
            self.meta["report"] = {**self.meta["report"], "path": str(source)}
        self.offsets = np.load(self.dir / "offsets.npy")
        self.lines = np.load(self.dir / "lines.npy")
        self.turns = np.load(self.dir / "turns.npy")
        self.row_ids = np.arange(len(self.lines), dtype=np.int64)  # dense: a row's id is its position
        self.first_loss = np.load(self.dir / "first_loss.npy")
        self.stage_codes = np.load(self.dir / "stages.npy")
        self.stage_names: list[str] = self.meta["stages"]
        self.counts_memo: dict[str, np.ndarray] = {}  # selection key -> response-token counts (StoreRows)
        total = int(self.offsets[-1])
        self.tokens = _map(self.dir / "tokens.u32", np.uint32, total)
        self.loss_mask = _map(self.dir / "loss_mask.u8", np.uint8, total)

    @property
    def source(self) -> str:
        return self.meta["source"]

    @property
    def content_sha256(self) -> str:
        return self.meta["content_sha256"]

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def build_report(self) -> SkipReport:
        """A fresh copy of what the build skipped (callers add their own skips to it)."""
        return SkipReport(**copy.deepcopy(self.meta["report"]))

    def __len__(self) -> int:
        return len(self.row_ids)

    def where(self, row_id: int) -> str:
        """Where store row `row_id` came from: 'file, line L (row L-1), messages[k]'."""
        unit = "line" if self.source.endswith((".jsonl", ".json")) else "row"
        turn = int(self.turns[row_id])
        place = Where(Path(self.source), int(self.lines[row_id]), unit).place
        return place + (f", messages[{turn}]" if turn >= 0 else "")

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

    @property
    def first_response(self) -> np.ndarray:
        """From the index (first_loss.npy), minus each row's left cut (a cut never passes the first response
        token: specdistill/data/selection.py)."""
        return np.maximum(self.store.first_loss[self.positions].astype(np.int64) - self.starts, 0)

    def response_tokens(self) -> np.ndarray:
        """Per row, summed on the memory-mapped mask (no row is built)."""
        s, out = self.store, np.zeros(len(self), dtype=np.int64)
        for i, (p, cut) in enumerate(zip(self.positions, self.starts)):
            out[i] = int(s.loss_mask[s.offsets[p] + cut:s.offsets[p + 1]].sum())
        return out

    def response_token_counts(self, vocab_size: int) -> np.ndarray:
        """[vocab_size] int64: how often each id is a response token in these rows (EAGLE-3's draft vocabulary is
        built from it). Counted once per store and selection, then read back at every start, resume, export and
        FSDP validation: kept in the store directory as counts/<selection_key>.npy (written atomically; another
        selection - other rows or other cuts - has another key) and in this process."""
        key = self.selection_key(vocab_size)
        counts = self.store.counts_memo.get(key)
        if counts is None:
            path = self.store.dir / "counts" / f"{key}.npy"
            counts = _load_counts(path, vocab_size)
            if counts is None:
                counts = self._count_response_tokens(vocab_size)
                _save_counts(path, counts)
            self.store.counts_memo[key] = counts
        return counts.copy()

    def selection_key(self, vocab_size: int) -> str:
        """Names this selection of the store's rows: its (position, left cut) pairs, in any order."""
        order = np.lexsort((self.starts, self.positions))
        h = hashlib.sha256(f"v{STORE_VERSION} vocab {vocab_size}\n".encode())
        h.update(np.ascontiguousarray(self.positions[order], dtype=np.int64).tobytes())
        h.update(np.ascontiguousarray(self.starts[order], dtype=np.int32).tobytes())
        return h.hexdigest()[:24]

    def _count_response_tokens(self, vocab_size: int) -> np.ndarray:
        """One sequential pass over the token files: each run of consecutive rows is one span of the flat arrays.
        A left cut removes prompt tokens only as select_rows makes it (never past the row's first response token);
        any other cut, and a row listed twice, is corrected row by row."""
        s, counts = self.store, np.zeros(vocab_size, dtype=np.int64)

        def add(a: int, b: int, sign: int = 1) -> None:
            for lo in range(a, b, _COUNT_BLOCK):
                hi = min(b, lo + _COUNT_BLOCK)
                ids = s.tokens[lo:hi][s.loss_mask[lo:hi].view(bool)]
                counts[:] += sign * np.bincount(ids, minlength=vocab_size)[:vocab_size]

        unique, first_at = np.unique(self.positions, return_index=True)
        for run in np.split(unique, np.flatnonzero(np.diff(unique) != 1) + 1) if len(unique) else []:
            add(int(s.offsets[run[0]]), int(s.offsets[run[-1] + 1]))
        first = np.zeros(len(self.positions), dtype=bool)
        first[first_at] = True
        for i in np.flatnonzero(first & (self.starts > s.first_loss[self.positions])):
            p = int(self.positions[i])  # a cut into the response: its tokens are not this row's
            add(int(s.offsets[p]), int(s.offsets[p]) + int(self.starts[i]), -1)
        for i in np.flatnonzero(~first):
            p = int(self.positions[i])
            add(int(s.offsets[p]) + int(self.starts[i]), int(s.offsets[p + 1]))
        return counts


_COUNT_BLOCK = 1 << 24  # tokens read at once when counting (64 MiB of ids)


def _load_counts(path: Path, vocab_size: int) -> np.ndarray | None:
    try:
        counts = np.load(path)
    except (OSError, ValueError):
        return None
    return counts if counts.shape == (vocab_size,) and counts.dtype == np.int64 else None


def _save_counts(path: Path, counts: np.ndarray) -> None:
    """Atomically (a unique temporary file renamed into place); a store this process may not write (a read-only
    shared cache) just keeps the counts in memory."""
    try:
        path.parent.mkdir(exist_ok=True)
        tmp = scratch_name(path, "tmp")
        with open(tmp, "wb") as f:  # a file object: np.save would append .npy to a name
            np.save(f, counts)
        os.replace(tmp, path)
    except OSError as e:
        log.info("%s: response-token counts not cached (%s)", path, e)


# ---- building -------------------------------------------------------------------------------------------------
def open_store(path: str | Path, tokenizer_dir: str | Path, cache_dir: str | Path, workers: int | None = None,
               progress: bool = True, cfg: DataConfig | None = None) -> TokenStore:
    """The store of `path` tokenized with the tokenizer (and chat template, generation_config.json) in
    `tokenizer_dir` - the target's directory - and the tokenization settings of `cfg` (default: DataConfig's):
    found in the cache, or built once (concurrent callers, on this node or on others sharing the cache, wait for
    one builder: specdistill/core/build_lock.py)."""
    path, tokenizer_dir, cache_dir, cfg = Path(path), Path(tokenizer_dir), Path(cache_dir), cfg or DataConfig()
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such data file")
    check_settings(cfg.loss_on, cfg.bad_rows)
    t0 = time.perf_counter()
    final = cache_dir / "tokens" / store_key(path, tokenizer_dir, cache_dir, cfg)
    if not is_complete(final):
        with build_lock(final):
            if not is_complete(final):
                _build(path, tokenizer_dir, final, workers or _cores(), progress, tokenize_settings(cfg))
    store = TokenStore(final, source=path)
    log.info("%s: %d rows, %d tokens, token store %s (%.2f s)", path, len(store), int(store.offsets[-1]), final,
             time.perf_counter() - t0)
    return store


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _build(path: Path, tokenizer_dir: Path, final: Path, workers: int, progress: bool, settings: dict) -> None:
    from tqdm import tqdm

    for leftover in dead_scratch(final):  # a crashed build's directory (this host's; the lock is ours)
        shutil.rmtree(leftover, ignore_errors=True)
    pieces = chunks(path)
    tmp = scratch_name(final)  # host, pid, random: never another builder's, on this node or another
    (tmp / "parts").mkdir(parents=True)
    t0 = time.perf_counter()
    tasks = ((k, c, str(tmp / "parts"), settings) for k, c in enumerate(with_data(pieces)))
    procs = max(1, min(workers, len(pieces)))
    results, rows, tokens = {}, 0, 0
    bar = tqdm(total=sum(c.size for c in pieces), disable=not progress, unit="B" if pieces and
               pieces[0].kind == "jsonl" else "row", unit_scale=True, desc=f"tokenize {path.name} ({procs} proc)")
    try:
        for result in _run_tasks(tasks, procs, str(tokenizer_dir), settings["chat_template_kwargs"]):
            results[result["k"]] = result
            rows += len(result["lines"])
            tokens += result["tokens"]
            elapsed = max(time.perf_counter() - t0, 1e-9)
            bar.update(pieces[result["k"]].size)
            bar.set_postfix(rows_per_s=f"{rows / elapsed:,.0f}", tokens_per_s=f"{tokens / elapsed:,.0f}")
        bar.close()
        _assemble(path, tmp, [results[k] for k in range(len(pieces))], time.perf_counter() - t0, procs, settings)
        publish_dir(tmp, final, is_complete)
    finally:
        bar.close()
        shutil.rmtree(tmp, ignore_errors=True)

class _Failed:
    def __init__(self, error: BaseException):
        self.error = error


def _run_tasks(tasks, procs: int, tokenizer_dir: str, template_kwargs: dict):
    """Chunk results as they finish: in this process for one worker (no start-up cost), else a spawned pool with
    at most 2 tasks per process handed out, so that the pieces `tasks` reads (a streamed row group's rows) are read
    as processes free up, not all at once."""
    if procs == 1:
        _init_worker(tokenizer_dir, template_kwargs)
        yield from map(_tokenize_chunk, tasks)
        return
    ctx = mp.get_context("spawn")  # the caller may hold threads (torch); fork would copy their locks
    done: queue.Queue = queue.Queue()
    with ctx.Pool(procs, initializer=_init_worker, initargs=(tokenizer_dir, template_kwargs)) as pool:
        def submit() -> int:
            task = next(tasks, None)
            if task is None:
                return 0
            pool.apply_async(_tokenize_chunk, (task,), callback=done.put, error_callback=lambda e: done.put(_Failed(e)))
            return 1

        in_flight = sum(submit() for _ in range(2 * procs))
        while in_flight:
            result = done.get()
            if isinstance(result, _Failed):
                raise result.error
            yield result
            in_flight += submit() - 1


def _assemble(path: Path, tmp: Path, results: list[dict], seconds: float, procs: int, settings: dict) -> None:
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
    np.save(tmp / "lines.npy", np.concatenate([r["lines"] for r in results]) if results else np.zeros(0, np.int64))
    np.save(tmp / "turns.npy", np.concatenate([r["turns"] for r in results]) if results else np.zeros(0, np.int32))
    np.save(tmp / "first_loss.npy", np.concatenate([r["first_loss"] for r in results]) if results else
            np.zeros(0, np.int32))
    np.save(tmp / "stages.npy", stages)
    report = SkipReport(str(path))
    for r in results:
        report.merge(r["report"])
    meta = {"version": STORE_VERSION, "source": str(path), "settings": settings, "rows": len(lengths),
            "input_rows": report.lines_seen, "tokens": int(offsets[-1]), "content_sha256": _content_sha256(tmp),
            "response_tokens": int(sum(r["response_tokens"] for r in results)), "stages": stage_names,
            "report": asdict(report), "build_seconds": round(seconds, 3), "build_processes": procs,
            "tokens_per_s": round(int(offsets[-1]) / max(seconds, 1e-9))}
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    shutil.rmtree(tmp / "parts", ignore_errors=True)


def _content_sha256(store_dir: Path) -> str:
    """sha256 of a store's rows: its row bounds, tokens and loss mask (read once, at the build)."""
    h = hashlib.sha256(np.load(store_dir / "offsets.npy").tobytes())
    for name in ("tokens.u32", "loss_mask.u8"):
        with open(store_dir / name, "rb") as f:
            while block := f.read(_COPY_BYTES):
                h.update(block)
    return h.hexdigest()


def _copy(src, dst) -> None:
    try:
        while os.copy_file_range(src.fileno(), dst.fileno(), _COPY_BYTES):
            pass
    except OSError:  # filesystems without copy_file_range
        shutil.copyfileobj(src, dst, _COPY_BYTES)


# ---- one chunk, in a worker process ---------------------------------------------------------------------------
_CHAT: ChatFormat | None = None


def _init_worker(tokenizer_dir: str, template_kwargs: dict) -> None:
    global _CHAT
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one process per core already
    _CHAT = ChatFormat.load(tokenizer_dir, template_kwargs)


class _ChunkWriter:
    """Accumulates one chunk's rows, then writes its two part files."""

    def __init__(self, path: str):
        self.report = SkipReport(path)
        self.ids: list[np.ndarray] = []
        self.masks: list[np.ndarray] = []
        self.lines: list[int] = []
        self.turns: list[int] = []
        self.first_loss: list[int] = []
        self.stages: list[str | None] = []

    def add(self, line: int, turn: int, ids: np.ndarray, mask: np.ndarray, stage: str | None) -> None:
        self.ids.append(ids.astype(np.uint32))
        self.masks.append(mask.astype(np.uint8))
        self.lines.append(line)
        self.turns.append(turn)
        self.first_loss.append(int(np.argmax(mask)))
        self.stages.append(stage)

    def finish(self, k: int, parts_dir: str) -> dict:
        self.report.rows_kept = len(self.lines)
        files = {"tokens.u32": f"{parts_dir}/{k}.tokens.u32", "loss_mask.u8": f"{parts_dir}/{k}.loss_mask.u8"}
        ids = np.concatenate(self.ids) if self.ids else np.zeros(0, np.uint32)
        mask = np.concatenate(self.masks) if self.masks else np.zeros(0, np.uint8)
        ids.tofile(files["tokens.u32"])
        mask.tofile(files["loss_mask.u8"])
        return {"k": k, "parts": files, "report": self.report, "tokens": len(ids), "response_tokens": int(mask.sum()),
                "lengths": np.array([len(a) for a in self.ids], dtype=np.int64),
                "lines": np.array(self.lines, dtype=np.int64), "turns": np.array(self.turns, dtype=np.int32),
                "first_loss": np.array(self.first_loss, dtype=np.int32), "stages": self.stages}


def _tokenize_chunk(task) -> dict:
    k, chunk, parts_dir, settings = task
    out = _ChunkWriter(chunk.path)
    if chunk.kind != "jsonl" and _add_pretokenized_tables(chunk, out, len(_CHAT.tokenizer), settings["bad_rows"]):
        return out.finish(k, parts_dir)
    for line, t, stage in parse_chunk(chunk, _CHAT, out.report, settings["loss_on"], settings["bad_rows"]):
        out.add(line, t.turn, np.asarray(t.input_ids, dtype=np.int64), np.asarray(t.loss_mask, dtype=np.uint8), stage)
    return out.finish(k, parts_dir)


def _add_pretokenized_tables(chunk: Chunk, out: _ChunkWriter, vocab: int, bad_rows: str) -> bool:
    """Pre-tokenized Parquet/Arrow rows, vectorised (no Python object per token). False when the chunk is not
    plainly pre-tokenized (other formats, nulls, non-integer lists) or, with data.bad_rows=skip, has a bad row: the
    per-row path then reads it and names (or skips) any bad row."""
    import pyarrow as pa

    pieces = list(tables(chunk))
    for table in pieces:
        names = set(table.column_names)
        if not {"input_ids", "loss_mask"} <= names or names & {"messages", "conversations", "prompt", "response"}:
            return False
        for name in ("input_ids", "loss_mask"):
            col = table.column(name)
            if col.null_count or not (pa.types.is_list(col.type) or pa.types.is_large_list(col.type)) or \
                    not pa.types.is_integer(col.type.value_type):
                return False
    first, arrays = chunk.first_row, []
    for table in pieces:  # every table checked before any row is added, so a bad_rows=skip fallback starts clean
        (offsets, ids), (mask_offsets, mask) = (_list_rows(_one_array(table.column(name)))
                                                for name in ("input_ids", "loss_mask"))
        stages = table.column("stage").to_pylist() if "stage" in table.column_names else [None] * len(table)
        try:
            _check_pretokenized(chunk, first, offsets, mask_offsets, ids.astype(np.int64), mask, vocab)
            bad_stage = next((i for i, stage in enumerate(stages) if stage is not None and not isinstance(stage, str)),
                             None)
            if bad_stage is not None:
                raise Where(Path(chunk.path), first + bad_stage, "row").error("stage", "a string", stages[bad_stage])
        except DatasetError:
            if bad_rows == "stop":
                raise
            return False
        arrays.append((offsets, ids.astype(np.int64), mask, stages))
        first += len(offsets) - 1
    first = chunk.first_row
    for offsets, ids, mask, stages in arrays:
        n = len(offsets) - 1
        for i in range(n):
            row_id = first + i
            a, b = offsets[i], offsets[i + 1]
            out.report.rows_seen += 1
            out.report.lines_seen += 1
            if b == a or not mask[a:b].any():
                out.report.skip("no_response_tokens", row_id)
                continue
            out.add(row_id, -1, ids[a:b], mask[a:b], stages[i])
        first += n
    return True


def _list_rows(column) -> tuple[np.ndarray, np.ndarray]:
    """(offsets from 0, values) of a list column's rows: a piece of a record batch is a slice, whose offsets start
    where the piece does and whose `.values` are the whole batch's."""
    offsets = column.offsets.to_numpy().astype(np.int64)
    values = column.values.slice(offsets[0], offsets[-1] - offsets[0]).to_numpy(zero_copy_only=False)
    return offsets - offsets[0], values


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
