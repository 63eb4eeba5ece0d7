"""Row formats and input files: what a training row looks like, and how it is read from JSONL, Parquet or Arrow.

Row formats, detected per row:
  chat           {"messages": [{"role", "content", ...}, ...], "tools": [...]?}   (OpenAI / vLLM chat format)
  ShareGPT       {"conversations": [{"from": "human"|"gpt"|"system"|"tool", "value": str}, ...], "tools": [...]?}
  prompt/resp.   {"prompt": str, "response": str}                                 (= one user, one assistant turn)
  pre-tokenized  {"input_ids": [int], "loss_mask": [0|1]}                          (specdistill-make-workload output)
A chat row trains its assistant turns (`data.loss_on`: all of them, the default, or the last): each is one row of the
token store, its prompt the target's chat template over the messages before it with the generation prompt and its
response the tokens the target generates for it, up to its stop token (specdistill/data/chat.py). Content may be a
string, a list of text parts or null; assistant messages may carry `tool_calls`, `tool` messages their results, and
the row a `tools` list: all go through the template as vLLM's chat server passes them. An assistant message with no
message before it is history only; one with nothing in it is skipped (`no_response_tokens`). A row may carry a
"stage" string (the workload's pipeline stage), reported per stage in the held-out acceptance.

Files: `.jsonl` (one JSON object per line; a row's place is its 0-based line index, blank lines count), `.parquet` and
`.arrow` (Arrow IPC file or stream, as `datasets.save_to_disk` writes; its 0-based row index), columns named as the
fields above. Each file is read in chunks (byte ranges of whole lines, row groups, record batches, and pieces of
~32 MiB of a larger row group or batch) so that specdistill/data/token_store.py can tokenize them in parallel; Parquet
and Arrow rows become Python objects a batch of ROW_BATCH rows at a time, never a whole table.

Malformed input raises `DatasetError` naming file, line (or row), field and, for chat rows, the message index
(template errors included); with `data.bad_rows=skip` the row is skipped instead, counted and named in the
`SkipReport` (reason `bad_row`, with the first errors), and the run's skipped-fraction stop still applies. A turn with
no response tokens is skipped and counted.
"""

import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from specdistill.data.chat import ChatError, ChatFormat, describe

SKIP_EXAMPLES = 5  # rows (and errors) kept per skip reason
JSONL_CHUNK_BYTES = 32 << 20  # one tokenization task; small enough to spread a file over 16+ cores
PIECE_BYTES = 32 << 20  # a Parquet row group or Arrow record batch (uncompressed) above it is cut into pieces
ROW_BATCH = 1024  # Parquet/Arrow rows made Python objects at once (read_chunk): bounds a reader's memory
FORMATS = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet", ".arrow": "arrow"}
LOSS_ON = ("all", "last")  # data.loss_on
BAD_ROWS = ("stop", "skip")  # data.bad_rows
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system",
                  "tool": "tool"}


class DatasetError(ValueError):
    pass


@dataclass
class SkipReport:
    """Counts in rows of the token store (trained turns); a bad row, whose turns are unknown, counts as one.
    Examples and errors name the input file's rows (0-based line or row index)."""

    path: str
    rows_seen: int = 0
    rows_kept: int = 0
    counts: dict[str, int] = field(default_factory=dict)  # reason -> rows skipped
    examples: dict[str, list[int]] = field(default_factory=dict)  # reason -> first input rows (line indexes)
    truncated: int = 0  # rows kept with their prompt cut on the left (data.truncate=left)
    truncated_tokens: int = 0
    lines_seen: int = 0  # input rows (conversations) read
    errors: list[str] = field(default_factory=list)  # the first bad rows' errors (data.bad_rows=skip)
    retokenized: int = 0  # turns whose response was tokenized apart from the prompt (specdistill/data/chat.py)

    def skip(self, reason: str, row_id: int, n: int = 1) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + n
        ids = self.examples.setdefault(reason, [])
        if len(ids) < SKIP_EXAMPLES:
            ids.append(int(row_id))

    def bad_row(self, row_id: int, error: str) -> None:
        self.rows_seen += 1
        self.skip("bad_row", row_id)
        if len(self.errors) < SKIP_EXAMPLES:
            self.errors.append(error)

    def merge(self, other: "SkipReport") -> None:
        self.rows_seen += other.rows_seen
        self.rows_kept += other.rows_kept
        self.lines_seen += other.lines_seen
        self.retokenized += other.retokenized
        self.errors.extend(other.errors[: SKIP_EXAMPLES - len(self.errors)])
        for reason, n in other.counts.items():
            self.counts[reason] = self.counts.get(reason, 0) + n
            ids = self.examples.setdefault(reason, [])
            ids.extend(other.examples.get(reason, [])[: SKIP_EXAMPLES - len(ids)])

    @property
    def skipped(self) -> int:
        return sum(self.counts.values())

    def summary(self) -> str:
        why = "; ".join(f"{r}={n} (rows {', '.join(map(str, self.examples[r]))}{', ...' if n > len(self.examples[r]) else ''})"
                        for r, n in sorted(self.counts.items()))
        cut = f", truncated {self.truncated} (-{self.truncated_tokens} prompt tokens)" if self.truncated else ""
        lines = f" from {self.lines_seen} input rows" if self.lines_seen not in (0, self.rows_seen) else ""
        errors = f"; first errors: {' | '.join(self.errors)}" if self.errors else ""
        return (f"{self.path}: kept {self.rows_kept}/{self.rows_seen} rows{lines}" + (f", skipped {why}" if why else "")
                + cut + errors)


class Where:
    """Formats 'file, line N (row N-1), field F: expected X, got Y' messages."""

    def __init__(self, path: Path, row_id: int, unit: str = "line"):
        self.path, self.row_id, self.unit = path, row_id, unit

    @property
    def place(self) -> str:
        return (f"{self.path}, line {self.row_id + 1} (row {self.row_id})" if self.unit == "line"
                else f"{self.path}, row {self.row_id}")

    def error(self, fld: str, expected: str, got=None) -> DatasetError:
        got_s = "" if got is None else f", got {describe(got)}"
        return DatasetError(f"{self.place}, field {fld!r}: expected {expected}{got_s}")

    def string(self, obj: dict, key: str, label: str | None = None) -> str:
        if key not in obj:
            raise self.error(label or key, "a string (field missing)")
        if not isinstance(obj[key], str):
            raise self.error(label or key, "a string", obj[key])
        return obj[key]


def check_settings(loss_on: str, bad_rows: str) -> None:
    if loss_on not in LOSS_ON:
        raise ValueError(f"data.loss_on={loss_on!r}; valid: {', '.join(LOSS_ON)}")
    if bad_rows not in BAD_ROWS:
        raise ValueError(f"data.bad_rows={bad_rows!r}; valid: {', '.join(BAD_ROWS)}")


# ---- one row -> its trained turns -----------------------------------------------------------------------------
@dataclass(frozen=True)
class TurnRow:
    """One trained turn of an input row: a row of the token store."""

    turn: int  # index of the trained assistant message in the row's messages; -1 for pre-tokenized rows
    input_ids: list[int]
    loss_mask: list[int]
    retokenized: bool = False


@dataclass(frozen=True)
class Conversation:
    messages: list  # as the row has them (validated and normalised by ChatFormat.normalise)
    tools: list | None
    names: dict[str, str]  # how errors name a message: "messages[1]" -> "response" for prompt/response rows, ...


def conversation(obj: dict, at: Where, need_response: bool = True) -> Conversation | None:
    """The chat messages of a chat, ShareGPT or prompt/response row; None for other rows."""
    if obj.get("messages") is not None:
        return Conversation(obj["messages"], _tools(obj, at), {})
    if obj.get("conversations") is not None:
        return Conversation(_sharegpt(obj["conversations"], at), _tools(obj, at), {"messages": "conversations"})
    if obj.get("prompt") is not None or obj.get("response") is not None:
        messages = [{"role": "user", "content": at.string(obj, "prompt")}]
        if need_response or obj.get("response") is not None:
            messages.append({"role": "assistant", "content": at.string(obj, "response")})
        return Conversation(messages, None, {"messages[0]": "prompt", "messages[1]": "response"})
    return None


def _tools(obj: dict, at: Where) -> list | None:
    tools = obj.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise at.error("tools", "a list of tool schemas (objects)", tools)
    return tools or None


def _sharegpt(turns, at: Where) -> list[dict]:
    if not isinstance(turns, list):
        raise at.error("conversations", 'a list of {"from": ..., "value": ...}', turns)
    out = []
    for i, t in enumerate(turns):
        if not isinstance(t, dict) or t.get("from") not in SHAREGPT_ROLES:
            raise at.error(f"conversations[{i}].from", f"one of {', '.join(SHAREGPT_ROLES)}",
                           t.get("from") if isinstance(t, dict) else t)
        out.append({"role": SHAREGPT_ROLES[t["from"]], "content": at.string(t, "value", f"conversations[{i}].value")})
    return out


def chat_error(e: ChatError, convo: Conversation, at: Where) -> DatasetError:
    """A ChatError as a DatasetError naming file, line and the row's own field names."""
    name = e.field
    for ours, theirs in convo.names.items():
        if name == ours or name.startswith(ours + ".") or name.startswith(ours + "["):
            name = theirs + name[len(ours):]
            break
    return DatasetError(f"{at.place}, field {name!r}: {e.message}")


def chat_turns(chat: ChatFormat, convo: Conversation, at: Where, loss_on: str = "all") -> list[TurnRow | None]:
    """The trained turns of a conversation (None: an empty assistant turn, nothing to learn)."""
    try:
        messages = chat.normalise(convo.messages)
        trained = [k for k, m in enumerate(messages) if m["role"] == "assistant" and k > 0]
        if not trained:
            raise ChatError("messages", "expected an assistant message after the first message (the turns to train); "
                            f"roles: {[m['role'] for m in messages]}")
        out = []
        for k in trained if loss_on == "all" else trained[-1:]:
            if chat.is_empty(messages[k]):
                out.append(None)
                continue
            t = chat.turn(messages, k, convo.tools)
            out.append(TurnRow(k, t.prompt + t.response, [0] * len(t.prompt) + [1] * len(t.response), t.retokenized))
        return out
    except ChatError as e:
        raise chat_error(e, convo, at) from None


def _pretokenized(obj: dict, at: Where):
    ids, mask = obj["input_ids"], obj.get("loss_mask")
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise at.error("input_ids", "a list of ints", ids)
    if mask is None:
        raise at.error("loss_mask", "a list of 0/1 beside input_ids (field missing)")
    if not isinstance(mask, list) or not all(m in (0, 1) and not isinstance(m, float) for m in mask):
        raise at.error("loss_mask", "a list of 0/1", mask)
    if len(mask) != len(ids):
        raise at.error("loss_mask", f"the same length as input_ids ({len(ids)}), got length {len(mask)}")
    return (ids, [int(m) for m in mask]) if any(mask) else None


def parse_row(chat: ChatFormat, obj, at: Where, loss_on: str = "all") -> list[TurnRow | None]:
    """The trained turns of one input row (None: a turn with no response tokens); DatasetError when malformed."""
    if isinstance(obj, DatasetError):  # a line read_chunk could not parse
        raise obj
    if not isinstance(obj, dict):
        raise at.error("<row>", "a JSON object", obj)
    if obj.get("input_ids") is not None:
        parsed = _pretokenized(obj, at)
        return [None if parsed is None else TurnRow(-1, *parsed)]
    convo = conversation(obj, at)
    if convo is None:
        raise at.error("<row>", 'one of the formats {"messages"}, {"conversations"}, {"prompt", "response"}, '
                       '{"input_ids", "loss_mask"}; '
                       f"keys present: {sorted(k for k, v in obj.items() if v is not None)}")
    return chat_turns(chat, convo, at, loss_on)


def row_stage(obj, at: Where) -> str | None:
    stage = obj.get("stage") if isinstance(obj, dict) else None
    if stage is not None and not isinstance(stage, str):
        raise at.error("stage", "a string", stage)
    return stage


def check_vocab(ids, vocab_size: int, at: Where) -> None:
    a = np.asarray(ids, dtype=np.int64)
    if a.size and (a.min() < 0 or a.max() >= vocab_size):
        bad = int(a[(a < 0) | (a >= vocab_size)][0])
        raise DatasetError(f"{at.place}: token id {bad} outside the tokenizer's vocab [0, {vocab_size}): "
                           "tokenizer does not match the target's vocab (was this file tokenized for another target?)")


def parse_chunk(chunk: "Chunk", chat: ChatFormat, report: SkipReport, loss_on: str = "all",
                bad_rows: str = "stop") -> Iterator[tuple[int, TurnRow, str | None]]:
    """(input row, trained turn, stage) for every trained turn of the chunk's rows, in order; seen, skipped and bad
    rows counted in `report`. The one parser of both the token store and `load_rows`."""
    vocab = len(chat.tokenizer)
    for row_id, obj, at in read_chunk(chunk):
        report.lines_seen += 1
        try:
            turns = parse_row(chat, obj, at, loss_on)
            stage = row_stage(obj, at)
            for t in turns:
                if t is not None:
                    check_vocab(t.input_ids, vocab, at)
        except DatasetError as e:
            if bad_rows == "stop":
                raise
            report.bad_row(row_id, str(e))
            continue
        for t in turns:
            report.rows_seen += 1
            if t is None:
                report.skip("no_response_tokens", row_id)
                continue
            report.retokenized += t.retokenized
            yield row_id, t, stage


# ---- files -> chunks of rows ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Chunk:
    """A piece of an input file one tokenization task reads: a byte range of whole JSONL lines (first_row = the
    line index of its first line), or Parquet row groups / Arrow record batches [start, stop) (first_row = the
    row index of the first one). A row group or record batch larger than PIECE_BYTES is cut into pieces of rows
    `rows` = [lo, hi) within it: an Arrow piece is a slice of the memory-mapped batch (free to read anywhere), a
    Parquet piece is `streamed`: one reader decodes the row group once, in order, and hands each piece its rows as
    Arrow IPC bytes (`data`; `with_data`), since a Parquet row group can only be decoded from its start."""

    path: str
    kind: str  # jsonl | parquet | arrow
    start: int
    stop: int
    first_row: int
    size: int  # bytes (jsonl) or rows: what the progress bar counts
    rows: tuple[int, int] | None = None  # a piece of one row group / record batch: its rows [lo, hi)
    streamed: bool = False  # a Parquet piece: its rows come in `data`
    data: bytes | None = field(default=None, repr=False, compare=False)  # Arrow IPC stream of a streamed piece's rows


def file_format(path: Path) -> str:
    kind = FORMATS.get(path.suffix.lower())
    if kind is None:
        raise DatasetError(f"{path}: unknown data file type {path.suffix!r}; expected one of "
                           f"{', '.join(sorted(FORMATS))}")
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such data file")
    return kind


def chunks(path: Path, chunk_bytes: int | None = None) -> list[Chunk]:
    """The file's pieces, in order. Every row group (record batch) of more than `chunk_bytes` (default
    PIECE_BYTES, uncompressed) is cut into pieces of about that size, so that a file written as one row group
    (pyarrow's default up to ~1M rows) is still spread over the tokenizing processes."""
    kind = file_format(path)
    if kind == "jsonl":
        return _jsonl_chunks(path, chunk_bytes or JSONL_CHUNK_BYTES)
    if kind == "parquet":
        meta = _pyarrow("parquet").ParquetFile(str(path)).metadata
        groups = [(meta.row_group(i).num_rows, meta.row_group(i).total_byte_size) for i in range(meta.num_row_groups)]
    else:
        groups = [(b.num_rows, b.nbytes) for b in _arrow_batches(path)]
    out, first, limit = [], 0, chunk_bytes or PIECE_BYTES
    for i, (n, nbytes) in enumerate(groups):
        per = n if nbytes <= limit else max(1, -(-n * limit // nbytes))
        if per >= n:
            out.append(Chunk(str(path), kind, i, i + 1, first, n))
        else:
            out.extend(Chunk(str(path), kind, i, i + 1, first + lo, min(n, lo + per) - lo, (lo, min(n, lo + per)),
                             streamed=kind == "parquet") for lo in range(0, n, per))
        first += n
    return out


def with_data(pieces: list[Chunk]) -> Iterator[Chunk]:
    """`pieces` in order, each streamed piece with its rows (`data`), decoded by one pass over its row group:
    what the process that hands pieces to the tokenizing processes calls, one piece ahead of each free process."""
    stream = None
    for c in pieces:
        if not c.streamed:
            yield c
            continue
        if stream is None or stream.key != (c.path, c.start) or stream.at != c.rows[0]:
            stream = _RowGroupStream(c.path, c.start, c.rows[0], c.rows[1] - c.rows[0])
        yield replace(c, data=_ipc_bytes(stream.take(c.rows[1] - c.rows[0])))


class _RowGroupStream:
    """The rows of one Parquet row group, in order, from `at` on (rows before it are decoded and dropped)."""

    def __init__(self, path: str, group: int, at: int, batch_rows: int):
        pf = _pyarrow("parquet").ParquetFile(path)
        self.key, self.at, self.buf = (path, group), 0, []
        self._batches = pf.iter_batches(batch_size=max(1, batch_rows), row_groups=[group])
        if at:
            self.take(at)

    def take(self, n: int):
        pa = _pyarrow("")
        have = sum(len(b) for b in self.buf)
        while have < n:
            batch = next(self._batches)
            self.buf.append(batch)
            have += len(batch)
        table = pa.Table.from_batches(self.buf) if self.buf else None
        if table is None:
            raise DatasetError(f"{self.key[0]}: row group {self.key[1]} ended before its metadata's row count")
        self.buf = table.slice(n).to_batches()
        self.at += n
        return table.slice(0, n)


def _ipc_bytes(table) -> bytes:
    """A table as an Arrow IPC stream: only the rows of a slice (pickling a slice may carry its whole buffers)."""
    pa = _pyarrow("")
    sink = pa.BufferOutputStream()
    with _pyarrow("ipc").new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def _jsonl_chunks(path: Path, chunk_bytes: int) -> list[Chunk]:
    """Byte ranges cut at line ends, with the line index each starts at (one pass counting newlines)."""
    out, start, line, total = [], 0, 0, os.path.getsize(path)
    with path.open("rb") as f:
        while start < total:
            f.seek(min(start + chunk_bytes, total))
            f.readline()  # to the end of the line the cut fell in
            stop = min(f.tell(), total)
            f.seek(start)
            lines = f.read(stop - start).count(b"\n")
            out.append(Chunk(str(path), "jsonl", start, stop, line, stop - start))
            line += lines
            start = stop
    return out


def read_chunk(chunk: Chunk, keep: Callable[[int], bool] | None = None) -> Iterator[tuple[int, object, Where]]:
    """(row_id, row object, where) for every non-blank row of the chunk (with `keep`, only the rows it keeps, the
    others not parsed). A line that is not JSON comes as a DatasetError naming it in place of the object (parse_row
    raises it, or data.bad_rows=skip counts it). Parquet and Arrow rows become Python objects ROW_BATCH at a time."""
    path = Path(chunk.path)
    if chunk.kind == "jsonl":
        with path.open("rb") as f:
            f.seek(chunk.start)
            data = f.read(chunk.stop - chunk.start)
        for i, raw in enumerate(data.split(b"\n")):
            row_id = chunk.first_row + i
            if not raw.strip() or (keep is not None and not keep(row_id)):
                continue
            at = Where(path, row_id)
            try:
                obj = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                why = f"{e.msg} at column {e.colno}" if isinstance(e, json.JSONDecodeError) else "not UTF-8"
                obj = DatasetError(f"{at.place}: malformed JSON ({why}); expected one JSON object per line")
            yield row_id, obj, at
        return
    row_id = chunk.first_row
    for table in tables(chunk):
        for batch in table.to_batches(max_chunksize=ROW_BATCH):
            ids = range(row_id, row_id + len(batch))
            row_id += len(batch)
            if keep is not None:
                mine = [i - ids[0] for i in ids if keep(i)]
                batch, ids = batch.take(mine), [ids[0] + i for i in mine]
            for i, obj in zip(ids, batch.to_pylist()):
                yield i, _without_nulls(obj), Where(path, i, unit="row")


def _without_nulls(value):
    """An Arrow row as its JSON line would be: Arrow gives every struct of a column all of the column's keys, the
    ones a row did not have as null (a tool call's arguments {"query": ...} beside another's {"city": ...} would
    render as {"query": ..., "city": null}), so null-valued keys are dropped, at any depth."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def iter_rows(path: Path, keep: Callable[[int], bool] | None = None) -> Iterator[tuple[int, object, Where]]:
    """Every row of a file in order, read as consumed (one pass; held a piece at a time): read_chunk over its
    pieces, streamed pieces decoded once."""
    for chunk in with_data(chunks(Path(path))):
        yield from read_chunk(chunk, keep)


def tables(chunk: Chunk):
    """The chunk's rows as Arrow tables (Parquet row groups, record batches, or a piece of one)."""
    if chunk.streamed:
        if chunk.data is None:  # a caller that did not go through with_data: decode the row group up to the piece
            chunk = next(with_data([chunk]))
        yield _pyarrow("ipc").open_stream(chunk.data).read_all()
    elif chunk.kind == "parquet":
        pf = _pyarrow("parquet").ParquetFile(chunk.path)
        for i in range(chunk.start, chunk.stop):
            yield pf.read_row_group(i)
    else:
        for i, batch in enumerate(_arrow_batches(Path(chunk.path))):
            if chunk.start <= i < chunk.stop:
                piece = batch if chunk.rows is None else batch.slice(chunk.rows[0], chunk.rows[1] - chunk.rows[0])
                yield _pyarrow("").Table.from_batches([piece])  # a table, like a row group (no copy)


def _arrow_batches(path: Path):
    """Record batches of an Arrow IPC file or stream, memory-mapped (a stream is read through, which costs no
    decoding: batches are views of the map)."""
    ipc = _pyarrow("ipc")
    source = _pyarrow("").memory_map(str(path))
    try:
        reader = ipc.open_file(source)
        return [reader.get_batch(i) for i in range(reader.num_record_batches)]
    except Exception:
        source = _pyarrow("").memory_map(str(path))
        try:
            return list(ipc.open_stream(source))
        except Exception as e:
            raise DatasetError(f"{path}: not an Arrow IPC file or stream ({e})") from None


def _pyarrow(module: str):
    try:
        import importlib

        return importlib.import_module(f"pyarrow.{module}" if module else "pyarrow")
    except ImportError:
        raise DatasetError("Parquet and Arrow inputs need pyarrow (pip install pyarrow)") from None


# ---- small files, in memory -------------------------------------------------------------------------------
def load_rows(path: str | Path, tokenizer, max_tokens: int, cfg=None, stages: dict | None = None):
    """All usable rows of a small file as TokenizedRows, rows longer than max_tokens skipped (counted). For tools
    and tests; training reads the memory-mapped token store (specdistill/data/token_store.py), which parses the same
    way and numbers rows the same way (row id = the trained turn's index in the file, too-long rows included).
    `tokenizer`: a ChatFormat (`ChatFormat.load(target_dir)` adds generation_config.json's eos to the stop tokens)
    or a tokenizer; `cfg`: a DataConfig for chat_template_kwargs, loss_on and bad_rows (default: the defaults);
    `stages`: a dict filled with row id -> the row's "stage" (rows without one left out), as the token store's."""
    from specdistill.core.contract import TokenizedRow
    from specdistill.data.config import DataConfig

    cfg = cfg or DataConfig()
    check_settings(cfg.loss_on, cfg.bad_rows)
    chat = tokenizer if isinstance(tokenizer, ChatFormat) else ChatFormat(tokenizer, cfg.chat_template_kwargs)
    path = Path(path)
    report, rows, row_id = SkipReport(str(path)), [], 0
    for chunk in with_data(chunks(path)):
        for line, t, stage in parse_chunk(chunk, chat, report, cfg.loss_on, cfg.bad_rows):
            if stages is not None and stage is not None:
                stages[row_id] = stage
            if len(t.input_ids) > max_tokens:
                report.skip("too_long", line)
            else:
                rows.append(TokenizedRow(row_id=row_id, input_ids=tuple(t.input_ids), loss_mask=tuple(t.loss_mask)))
            row_id += 1
    report.rows_kept = len(rows)
    return rows, report


def check_tokenizer_matches(tokenizer, target_config) -> None:
    """Raise when the tokenizer can emit ids the target's embedding table does not have.

    `target_config` is a transformers config or its dict; multimodal configs keep vocab_size in text_config.
    (A config vocab larger than the tokenizer is normal: tables are padded to a multiple of 64 or 128.)
    """
    cfg = target_config.to_dict() if hasattr(target_config, "to_dict") else dict(target_config)
    vocab_size = cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")
    if vocab_size is None:
        raise DatasetError("target config has no vocab_size (nor text_config.vocab_size); is it a causal LM config?")
    if len(tokenizer) > vocab_size:
        raise DatasetError(f"tokenizer has {len(tokenizer)} tokens but the target's vocab_size is {vocab_size}: "
                           "tokenizer does not match the target's vocab; load the tokenizer from the target directory")
