"""Row formats and input files: what a training row looks like, and how it is read from JSONL, Parquet or Arrow.

Three row formats, detected per row:
  chat           {"messages": [..., {"role": "assistant", "content": str}]}  (last message = the response)
  prompt/resp.   {"prompt": str, "response": str}                           (prompt = one user turn)
  pre-tokenized  {"input_ids": [int], "loss_mask": [0|1]}                   (e.g. specdistill/data/synthetic.py output)
For the first two, prompt = chat template of the earlier turns with add_generation_prompt=True, response =
tokens of content + "<|im_end|>"; the two token lists are concatenated (as generation produces them). A row may
carry a "stage" string (the workload's pipeline stage), reported per stage in the held-out acceptance.

Files: `.jsonl` (one JSON object per line; row_id = 0-based line index, blank lines count), `.parquet` and
`.arrow` (Arrow IPC file or stream, as `datasets.save_to_disk` writes; row_id = 0-based row index), columns named
as the fields above. Each file is read in chunks (byte ranges of whole lines, row groups, record batches) so that
specdistill/data/token_store.py can tokenize them in parallel.

Malformed input raises `DatasetError` naming file, line (or row) and field. A row with no response tokens is
skipped and counted in a `SkipReport`.
"""

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

END_OF_TURN = "<|im_end|>"
SKIP_EXAMPLES = 5  # row ids kept per skip reason
JSONL_CHUNK_BYTES = 32 << 20  # one tokenization task; small enough to spread a file over 16+ cores
FORMATS = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet", ".arrow": "arrow"}


class DatasetError(ValueError):
    pass


@dataclass
class SkipReport:
    path: str
    rows_seen: int = 0
    rows_kept: int = 0
    counts: dict[str, int] = field(default_factory=dict)  # reason -> rows skipped
    examples: dict[str, list[int]] = field(default_factory=dict)  # reason -> first row ids
    truncated: int = 0  # rows kept with their prompt cut on the left (data.truncate=left)
    truncated_tokens: int = 0

    def skip(self, reason: str, row_id: int, n: int = 1) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + n
        ids = self.examples.setdefault(reason, [])
        if len(ids) < SKIP_EXAMPLES:
            ids.append(int(row_id))

    def merge(self, other: "SkipReport") -> None:
        self.rows_seen += other.rows_seen
        self.rows_kept += other.rows_kept
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
        return f"{self.path}: kept {self.rows_kept}/{self.rows_seen} rows" + (f", skipped {why}" if why else "") + cut


class Where:
    """Formats 'file, line N (row N-1), field F: expected X, got Y' messages."""

    def __init__(self, path: Path, row_id: int, unit: str = "line"):
        self.path, self.row_id, self.unit = path, row_id, unit

    @property
    def place(self) -> str:
        return (f"{self.path}, line {self.row_id + 1} (row {self.row_id})" if self.unit == "line"
                else f"{self.path}, row {self.row_id}")

    def error(self, fld: str, expected: str, got=None) -> DatasetError:
        got_s = "" if got is None else f", got {type(got).__name__} {_clip(got)}"
        return DatasetError(f"{self.place}, field {fld!r}: expected {expected}{got_s}")

    def string(self, obj: dict, key: str, label: str | None = None) -> str:
        if key not in obj:
            raise self.error(label or key, "a string (field missing)")
        if not isinstance(obj[key], str):
            raise self.error(label or key, "a string", obj[key])
        return obj[key]


def _clip(value, n: int = 60) -> str:
    s = repr(value)
    return s if len(s) <= n else s[: n - 3] + "..."


# ---- one row -> (input_ids, loss_mask) ------------------------------------------------------------------------
def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _from_turns(tokenizer, turns: list[dict], response: str) -> tuple[list[int], list[int]] | None:
    """None when the response is empty (only whitespace): nothing the drafter could learn."""
    if not response.strip():
        return None
    prompt = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    prompt_ids, response_ids = _encode(tokenizer, prompt), _encode(tokenizer, response + END_OF_TURN)
    return prompt_ids + response_ids, [0] * len(prompt_ids) + [1] * len(response_ids)


def _chat(tokenizer, obj: dict, at: Where):
    messages = obj["messages"]
    if not isinstance(messages, list) or len(messages) < 2:
        raise at.error("messages", "a list of >= 2 messages (prompt turns, then the assistant's response)", messages)
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise at.error(f"messages[{i}]", 'an object {"role": ..., "content": ...}', m)
        at.string(m, "role", f"messages[{i}].role")
        at.string(m, "content", f"messages[{i}].content")
    if messages[-1]["role"] != "assistant":
        raise at.error(f"messages[{len(messages) - 1}].role", "'assistant' (the last message is the response)",
                       messages[-1]["role"])
    return _from_turns(tokenizer, messages[:-1], messages[-1]["content"])


def _prompt_response(tokenizer, obj: dict, at: Where):
    prompt, response = at.string(obj, "prompt"), at.string(obj, "response")
    return _from_turns(tokenizer, [{"role": "user", "content": prompt}], response)


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


def parse_row(tokenizer, obj, at: Where) -> tuple[list[int], list[int]] | None:
    """(input_ids, loss_mask) of one row, or None when it has no response tokens; DatasetError when malformed."""
    if not isinstance(obj, dict):
        raise at.error("<row>", "a JSON object", obj)
    if obj.get("input_ids") is not None:
        return _pretokenized(obj, at)
    if obj.get("messages") is not None:
        return _chat(tokenizer, obj, at)
    if obj.get("prompt") is not None or obj.get("response") is not None:
        return _prompt_response(tokenizer, obj, at)
    raise at.error("<row>", 'one of the formats {"messages"}, {"prompt", "response"}, {"input_ids", "loss_mask"}; '
                   f"keys present: {sorted(k for k, v in obj.items() if v is not None)}")


def row_stage(obj, at: Where) -> str | None:
    stage = obj.get("stage") if isinstance(obj, dict) else None
    if stage is not None and not isinstance(stage, str):
        raise at.error("stage", "a string", stage)
    return stage


def check_vocab(ids, vocab_size: int, at: Where) -> None:
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise DatasetError(f"{at.place}: token id {bad[0]} outside the tokenizer's vocab [0, {vocab_size}): "
                           "tokenizer does not match the target's vocab (was this file tokenized for another target?)")


# ---- files -> chunks of rows ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Chunk:
    """A piece of an input file one tokenization task reads: a byte range of whole JSONL lines (first_row = the
    line index of its first line), or Parquet row groups / Arrow record batches [start, stop) (first_row = the
    row index of the first one)."""

    path: str
    kind: str  # jsonl | parquet | arrow
    start: int
    stop: int
    first_row: int
    size: int  # bytes (jsonl) or rows: what the progress bar counts


def file_format(path: Path) -> str:
    kind = FORMATS.get(path.suffix.lower())
    if kind is None:
        raise DatasetError(f"{path}: unknown data file type {path.suffix!r}; expected one of "
                           f"{', '.join(sorted(FORMATS))}")
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such data file")
    return kind


def chunks(path: Path, chunk_bytes: int | None = None) -> list[Chunk]:
    kind = file_format(path)
    if kind == "jsonl":
        return _jsonl_chunks(path, chunk_bytes or JSONL_CHUNK_BYTES)
    if kind == "parquet":
        meta = _pyarrow("parquet").ParquetFile(str(path)).metadata
        sizes = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
    else:
        sizes = [b.num_rows for b in _arrow_batches(path)]
    out, first = [], 0
    for i, n in enumerate(sizes):
        out.append(Chunk(str(path), kind, i, i + 1, first, n))
        first += n
    return out


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


def read_chunk(chunk: Chunk) -> Iterator[tuple[int, object, Where]]:
    """(row_id, row object, where) for every non-blank row of the chunk; malformed JSON raises naming the line."""
    path = Path(chunk.path)
    if chunk.kind == "jsonl":
        with path.open("rb") as f:
            f.seek(chunk.start)
            data = f.read(chunk.stop - chunk.start)
        for i, raw in enumerate(data.split(b"\n")):
            if not raw.strip():
                continue
            row_id = chunk.first_row + i
            at = Where(path, row_id)
            try:
                yield row_id, json.loads(raw), at
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                why = f"{e.msg} at column {e.colno}" if isinstance(e, json.JSONDecodeError) else "not UTF-8"
                raise DatasetError(f"{at.place}: malformed JSON ({why}); expected one JSON object per "
                                   "line") from None
        return
    row_id = chunk.first_row
    for table in _tables(chunk):
        for obj in table.to_pylist():
            yield row_id, obj, Where(path, row_id, unit="row")
            row_id += 1


def _tables(chunk: Chunk):
    if chunk.kind == "parquet":
        pf = _pyarrow("parquet").ParquetFile(chunk.path)
        for i in range(chunk.start, chunk.stop):
            yield pf.read_row_group(i)
    else:
        for i, batch in enumerate(_arrow_batches(Path(chunk.path))):
            if chunk.start <= i < chunk.stop:
                yield batch


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
def load_rows(path: str | Path, tokenizer, max_tokens: int):
    """All usable rows of a small file as TokenizedRows, rows longer than max_tokens skipped (counted). For tools
    and tests; training reads the memory-mapped token store (specdistill/data/token_store.py), which parses the same way."""
    from specdistill.core.contract import TokenizedRow

    path = Path(path)
    vocab = len(tokenizer)
    report, rows = SkipReport(str(path)), []
    for chunk in chunks(path):
        for row_id, obj, at in read_chunk(chunk):
            report.rows_seen += 1
            parsed = parse_row(tokenizer, obj, at)
            if parsed is None:
                report.skip("no_response_tokens", row_id)
                continue
            ids, mask = parsed
            check_vocab(ids, vocab, at)
            if len(ids) > max_tokens:
                report.skip("too_long", row_id)
                continue
            rows.append(TokenizedRow(row_id=row_id, input_ids=tuple(ids), loss_mask=tuple(mask)))
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
