"""Load training rows from JSONL into `TokenizedRow`s, with loss_mask = 1 on response tokens only.

Three row formats, detected per line:
  chat           {"messages": [..., {"role": "assistant", "content": str}]}  (last message = the response)
  prompt/resp.   {"prompt": str, "response": str}                           (prompt = one user turn)
  pre-tokenized  {"input_ids": [int], "loss_mask": [0|1]}                   (e.g. launch/make_workload.py output)
For the first two, prompt = chat template of the earlier turns with add_generation_prompt=True, response =
tokens of content + "<|im_end|>"; the two token lists are concatenated (as generation produces them).

Malformed input raises `DatasetError` naming file, line and field. Rows with no response tokens, or longer than
max_tokens, are skipped and counted in a `SkipReport`. row_id = 0-based line index in the file.
"""

import json
from dataclasses import dataclass, field
from pathlib import Path

from core.contract import TokenizedRow

END_OF_TURN = "<|im_end|>"
SKIP_EXAMPLES = 5  # row ids kept per skip reason


class DatasetError(ValueError):
    pass


@dataclass
class SkipReport:
    path: str
    rows_seen: int = 0
    rows_kept: int = 0
    counts: dict[str, int] = field(default_factory=dict)  # reason -> rows skipped
    examples: dict[str, list[int]] = field(default_factory=dict)  # reason -> first row ids

    def skip(self, reason: str, row_id: int) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + 1
        ids = self.examples.setdefault(reason, [])
        if len(ids) < SKIP_EXAMPLES:
            ids.append(row_id)

    @property
    def skipped(self) -> int:
        return sum(self.counts.values())

    def summary(self) -> str:
        why = "; ".join(f"{r}={n} (rows {', '.join(map(str, self.examples[r]))}{', ...' if n > len(self.examples[r]) else ''})"
                        for r, n in sorted(self.counts.items()))
        return f"{self.path}: kept {self.rows_kept}/{self.rows_seen} rows" + (f", skipped {why}" if why else "")


class _Where:
    """Formats 'file, line N (row N-1), field F: expected X, got Y' messages."""

    def __init__(self, path: Path, row_id: int):
        self.path, self.row_id = path, row_id

    def error(self, fld: str, expected: str, got=None) -> DatasetError:
        got_s = "" if got is None else f", got {type(got).__name__} {_clip(got)}"
        return DatasetError(f"{self.path}, line {self.row_id + 1} (row {self.row_id}), field {fld!r}: "
                            f"expected {expected}{got_s}")

    def string(self, obj: dict, key: str, label: str | None = None) -> str:
        if key not in obj:
            raise self.error(label or key, "a string (field missing)")
        if not isinstance(obj[key], str):
            raise self.error(label or key, "a string", obj[key])
        return obj[key]


def _clip(value, n: int = 60) -> str:
    s = repr(value)
    return s if len(s) <= n else s[: n - 3] + "..."


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _from_turns(tokenizer, turns: list[dict], response: str) -> tuple[list[int], list[int]] | None:
    """None when the response is empty (only whitespace): nothing the drafter could learn."""
    if not response.strip():
        return None
    prompt = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    prompt_ids, response_ids = _encode(tokenizer, prompt), _encode(tokenizer, response + END_OF_TURN)
    return prompt_ids + response_ids, [0] * len(prompt_ids) + [1] * len(response_ids)


def _chat(tokenizer, obj: dict, at: _Where):
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


def _prompt_response(tokenizer, obj: dict, at: _Where):
    prompt, response = at.string(obj, "prompt"), at.string(obj, "response")
    return _from_turns(tokenizer, [{"role": "user", "content": prompt}], response)


def _pretokenized(obj: dict, at: _Where):
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


def _parse(tokenizer, obj, at: _Where):
    if not isinstance(obj, dict):
        raise at.error("<row>", "a JSON object", obj)
    if "input_ids" in obj:
        return _pretokenized(obj, at)
    if "messages" in obj:
        return _chat(tokenizer, obj, at)
    if "prompt" in obj or "response" in obj:
        return _prompt_response(tokenizer, obj, at)
    raise at.error("<row>", 'one of the formats {"messages"}, {"prompt", "response"}, {"input_ids", "loss_mask"}; '
                   f"keys present: {sorted(obj)}")


def load_rows(path: str | Path, tokenizer, max_tokens: int) -> tuple[list[TokenizedRow], SkipReport]:
    """All usable rows of a JSONL file (blank lines are ignored but still count as rows for row_id)."""
    path = Path(path)
    vocab = len(tokenizer)
    report, rows = SkipReport(str(path)), []
    with path.open() as f:
        for row_id, line in enumerate(f):
            if not line.strip():
                continue
            report.rows_seen += 1
            at = _Where(path, row_id)
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetError(f"{path}, line {row_id + 1} (row {row_id}): malformed JSON ({e.msg} at column "
                                   f"{e.colno}); expected one JSON object per line") from None
            parsed = _parse(tokenizer, obj, at)
            if parsed is None:
                report.skip("no_response_tokens", row_id)
                continue
            ids, mask = parsed
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise DatasetError(f"{path}, line {row_id + 1} (row {row_id}): token id {bad[0]} outside the "
                                   f"tokenizer's vocab [0, {vocab}): tokenizer does not match the target's vocab "
                                   "(was this file tokenized for another target?)")
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
