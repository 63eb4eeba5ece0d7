"""Your prompts and conversations, the target's answers: rows ready for `data=jsonl`, streamed, written as they
finish, resumable, shardable over GPUs.

    specdistill-regenerate target.path=DIR input=chats.jsonl output=train.jsonl \
        [turns=all|last] [shard=I/N] [backend=auto|vllm|hf] [max_new_tokens=256] [temperature=0] [top_p=1] \
        [stop=[...]] [batch_size=32] [seed=0] ['chat_template_kwargs={enable_thinking: false}']
    specdistill-regenerate output=train.jsonl merge=N          # joins the N shards' files, in input order

A drafter must learn the target's outputs, not the dataset's: whatever wrote the responses in your file, this
replaces them by the target's own (greedy by default). Input rows (JSONL, Parquet or Arrow; any mix of formats):
  {"messages": [...], "tools": [...]?}  a conversation (ShareGPT {"conversations": [...]} and {"prompt", "response"}
                                     the same). Its turns are regenerated in order, each the way a chat server
                                     would answer it: the prompt is the chat template over the messages before the
                                     turn - earlier assistant turns as the target regenerated them, the user and tool
                                     messages as recorded - with the generation prompt and `chat_template_kwargs`
                                     (specdistill/data/chat.py). `turns=all` (default) regenerates every assistant
                                     message after the first message and, when the conversation ends on another
                                     role, a new final turn; `turns=last` only the last of those, after the
                                     recorded history.
  {"input_ids": [...]} (+ loss_mask) raw prompt token ids; with a loss_mask, only the tokens before its first 1
Output rows, one JSON object per regenerated turn, in the order they finish: {"id", "turn", "last", "input_ids",
"loss_mask", "response_text", "finish_reason"}: id = the input row's line (or row) index, turn = the assistant
message's index in its messages (-1 for token-id prompts), last = the conversation's last row, loss_mask 1 exactly on
the generated tokens (the stop token included when one ended the response). A "stage" field of the input is carried
over. Each row is a pre-tokenized training row (one row of the token store).

The history a turn is answered after: where the target said exactly what the recorded turn renders to, the recorded
message (its reasoning and tool calls as they were); otherwise the decoded response (special tokens dropped, as a
chat server returns it without a reasoning or tool parser), so a template that parses its own reasoning from the
text (Qwen3's </think>) still drops it from later prompts. A recorded turn with tool calls must call them again: its
calls' text as the template renders them must appear in the regenerated turn, or the recorded tool results that
follow answer calls the target did not make - the conversation ends at that turn (the turn itself is written, with
"ended": "tool_call_differs", counted in the summary). So does a turn recorded without a call where the target calls
one of the row's tools (the text the template renders such a call with, through the tool's name, is in its answer)
and a later turn follows: the recording has no result for that call. Harmony-format targets (gpt-oss), whose replies a server parses
into channels, keep the recorded history where they reproduce it and otherwise need `turns=last`.

Scale: the input is read as it is consumed (never held whole; a Parquet row group in pieces), each row is written
and flushed as it finishes, and a re-run with the same output resumes: conversations with their last row written are
skipped unparsed, one cut mid-way continues after the turns it has (their history rebuilt from the rows written), a
torn last line is cut off (a crash, kill -9 included, loses at most the turns in flight). A resume is refused when
the output was written from another input, target or settings (OUTPUT.regenerate.json records them; the message says
which), and a second process writing the same output is refused (a lock beside it: specdistill/core/build_lock.py).
`shard=I/N` regenerates the input rows whose index is I modulo N into OUTPUT's shard file (train.shard-I-of-N.jsonl),
so N GPUs (or nodes) share one file; `merge=N` then writes OUTPUT from the N finished shards in input order.
backend=vllm (the default where vLLM is installed; `auto` says so when it falls back) keeps one engine busy with
continuous batching, a conversation's next turn queued as its turn finishes; backend=hf runs transformers in
left-padded batches, a window of conversations one turn at a time (one row at a time for recurrent hybrids).

Stops: the target's stop tokens (specdistill/data/chat.py: its tokenizer's eos, generation_config.json's eos ids, its
template's end of turn; the same as training's), plus `stop` (token strings); finish_reason is "stop" when one ended
the response. Rows are kept to what training takes whole (specdistill.core.vllm_engine.max_row_tokens: context - 1):
a turn whose prompt leaves no room ends its conversation there, counted and named (row, tokens, context); responses
are capped to fit.
"""

import hashlib
import json
import logging
import os
import re
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from specdistill.core.build_lock import LockHeld, build_lock, scratch_name
from specdistill.core.vllm_engine import max_row_tokens
from specdistill.data.chat import REASONING_KEYS, ChatError, ChatFormat
from specdistill.data.formats import Conversation, DatasetError, Where, chat_error, conversation, iter_rows
from specdistill.data.generate import GenerationSettings, Request, VLLMGenerator, generate, resolve_backend
from specdistill.data.token_store import content_digest, tokenizer_digest

log = logging.getLogger("specdistill.regenerate")
HF_WINDOW = 16  # batches of conversations the hf backend holds at once (sorted by length inside the window)
TURNS = ("all", "last")
# The settings that change what is written: a resume must have the same (backend and batch_size do not).
RESUME_SETTINGS = ("max_new_tokens", "temperature", "top_p", "stop", "seed", "dtype", "chat_template_kwargs", "turns")
_ROW_PREFIX = re.compile(rb'^\{"id": (\d+), "turn": (-?\d+), "last": (true|false),')
_WEIGHTS = ("*.safetensors", "*.bin", "*.pt")
_SAMPLE_BYTES = 1 << 20


@dataclass
class RegenerateSettings:
    input: str = "???"
    output: str = "???"
    turns: str = "all"  # all: every assistant turn, in order | last: the last one, after the recorded history
    shard: str | None = None  # I/N: the input rows whose index is I modulo N, into OUTPUT's shard file
    merge: int | None = None  # N: write OUTPUT from its N finished shard files, in input order (no generation)
    backend: str = "auto"  # auto (vllm where installed) | vllm | hf
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    stop: list[str] = field(default_factory=list)
    batch_size: int = 32  # hf: prompts per batch
    seed: int = 0
    dtype: str | None = None  # None: the checkpoint's own
    # Variables of the target's chat template: the same as the run's data.chat_template_kwargs.
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)


# ---- conversations ----------------------------------------------------------------------------------------------
class Dialogue:
    """One input row's turns to regenerate, in order, and its history as the target has answered so far."""

    def __init__(self, row_id: int, stage: str | None, chat: ChatFormat | None, messages: list[dict] | None = None,
                 tools: list | None = None, positions: list[int] | None = None, prompt: list[int] | None = None,
                 at: Where | None = None, names: dict | None = None):
        self.row_id, self.stage, self.chat, self.tools, self.at, self.names = row_id, stage, chat, tools, at, names
        self.recorded = messages  # normalised; None for a token-id prompt
        self.history = list(messages or [])
        self.positions = positions or [-1]  # -1: the token-id prompt
        self._prompt = prompt
        self.i, self.ended = 0, None  # next position; why the conversation ended early

    @property
    def turn(self) -> int:
        return self.positions[self.i]

    @property
    def finished(self) -> bool:
        return self.ended is not None or self.i == len(self.positions)

    def prompt(self) -> list[int]:
        if self._prompt is not None:
            return self._prompt
        try:
            return self.chat.prompt_ids(self.history[:self.turn], self.tools)
        except ChatError as e:
            raise self._error(e) from None

    def answer(self, response: list[int]) -> None:
        """Take the target's answer to the current turn into the history; move to the next turn."""
        if self.recorded is not None:
            k = self.turn
            recorded = self.recorded[k] if k < len(self.recorded) else None
            try:
                message = reply_message(self.chat, self.history[:k], recorded, response, self.tools)
            except ChatError as e:
                raise self._error(e) from None
            # A call where none was recorded matters only where a later turn's history would follow this one.
            new_call = (self.i + 1 < len(self.positions) and message is not recorded
                        and not (recorded or {}).get("tool_calls")
                        and unrecorded_call(self.chat, self.history[:k], response, self.tools))
            if message is None or new_call:
                self.ended = "tool_call_differs"
            elif k < len(self.history):
                self.history[k] = message
            else:
                self.history.append(message)
        self.i += 1

    def _error(self, e: ChatError) -> DatasetError:
        return chat_error(e, Conversation(self.recorded, self.tools, self.names or {}), self.at)


def dialogue(row_id: int, obj, at: Where, chat: ChatFormat, turns: str) -> Dialogue:
    """The turns of an input row to regenerate (ValueError naming file, row and field when it has none)."""
    if isinstance(obj, DatasetError):  # a line that is not JSON
        raise obj
    if not isinstance(obj, dict):
        raise ValueError(f"{at.place}: expected a JSON object")
    stage = obj.get("stage") if isinstance(obj.get("stage"), str) else None
    if obj.get("input_ids") is not None:
        ids, mask = obj["input_ids"], obj.get("loss_mask")
        if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids) or not ids:
            raise ValueError(f"{at.place}, field 'input_ids': expected a non-empty list of ints")
        if mask is not None:
            ids = ids[: mask.index(1)] if 1 in mask else ids
        return Dialogue(row_id, stage, chat, prompt=ids)
    convo = conversation(obj, at, need_response=False)
    if convo is None:
        raise ValueError(f"{at.place}: expected one of the fields messages, prompt, input_ids (or ShareGPT's "
                         f"conversations); got {sorted(obj)}")
    try:
        messages = chat.normalise(convo.messages)
    except ChatError as e:
        raise chat_error(e, convo, at) from None
    positions = [k for k, m in enumerate(messages) if m["role"] == "assistant" and k > 0]
    if messages[-1]["role"] != "assistant":
        positions.append(len(messages))  # a new turn after the last message
    if not positions:
        raise chat_error(ChatError("messages", "no message before the assistant's"), convo, at)
    return Dialogue(row_id, stage, chat, messages, convo.tools, positions if turns == "all" else positions[-1:],
                    at=at, names=convo.names)


def reply_message(chat: ChatFormat, before: list[dict], recorded: dict | None, response: list[int],
                  tools: list | None) -> dict | None:
    """The assistant message a chat client sends back after the target answered `response` (see the module
    docstring); None when the recorded turn's tool calls are not in it."""
    if recorded is not None and not chat.is_empty(recorded):
        try:
            if chat.turn([*before, recorded], len(before), tools).response == response:
                return recorded  # the target said what was recorded
        except ChatError:
            pass  # the recorded turn does not render as trained: compare its tool calls only
    body = response[:-1] if response and response[-1] in chat.stop_ids else response
    calls = (recorded or {}).get("tool_calls")
    if not calls:
        text = chat.tokenizer.decode(body, skip_special_tokens=True)
        return chat.normalise([{"role": "assistant", "content": text}])[0]
    raw = chat.tokenizer.decode(body, skip_special_tokens=False)
    call = tool_call_text(chat, before, recorded, tools)
    if not call or call not in raw:
        return None
    content = raw.replace(call, "", 1)
    for token in chat.tokenizer.all_special_tokens:
        content = content.replace(token, "")
    return chat.normalise([{"role": "assistant", "content": content.strip(), "tool_calls": calls}])[0]


def unrecorded_call(chat: ChatFormat, before: list[dict], response: list[int], tools: list | None) -> bool:
    """Whether the target's answer to a turn recorded without tool calls calls one of the row's tools: the text the
    template renders a call to it with begins, through the tool's name and its closing quote (Llama 3
    '{"name": "search"', Qwen3 '<tool_call>\\n{"name": "search"'), somewhere in the answer. The recording then goes
    on with no result for it."""
    raw = chat.tokenizer.decode(response, skip_special_tokens=False)
    return any(opening in raw for opening in call_openings(chat, before, tools))


def call_openings(chat: ChatFormat, before: list[dict], tools: list | None) -> list[str]:
    """For each function of `tools`, how the template's rendering of a call to it begins, through its name and the
    character after it (none where the template does not render the call with its name: such calls go undetected)."""
    out = []
    for spec in tools or []:
        name = (spec.get("function") or {}).get("name") if isinstance(spec, dict) else None
        if not isinstance(name, str) or not name:
            continue
        probe = {"role": "assistant", "content": None,
                 "tool_calls": [{"type": "function", "function": {"name": name, "arguments": {}}}]}
        text = tool_call_text(chat, before, chat.normalise([probe])[0], tools)
        # The name's last place standing alone: a name like "a" or "tool" also occurs inside the template's own
        # text before it ('{"name": "a"', '<tool_call>'); the call's name comes after that.
        places = list(re.finditer(rf"(?<!\w){re.escape(name)}(?!\w)", text or ""))
        if places:
            out.append(text[:places[-1].end() + 1])  # with what closes the name: "search", not "searching"
    return out


def tool_call_text(chat: ChatFormat, before: list[dict], recorded: dict, tools: list | None) -> str | None:
    """The text the template renders for the recorded message's tool calls: its rendering of the calls with no
    content, less what it renders for no calls and no content (backed off to whitespace, so a tag it shares with the
    empty turn's opening stays whole)."""
    empty = "" if chat.content_format == "string" else []
    base = {k: v for k, v in recorded.items() if k not in REASONING_KEYS} | {"content": empty}
    try:
        with_calls = chat.render([*before, base], tools, generation_prompt=False)
        without = chat.render([*before, {k: v for k, v in base.items() if k != "tool_calls"}], tools,
                              generation_prompt=False)
    except ChatError:
        return None
    p = 0
    while p < min(len(with_calls), len(without)) and with_calls[p] == without[p]:
        p += 1
    while p > 0 and not with_calls[p - 1].isspace():
        p -= 1
    s = 0
    while s < min(len(with_calls), len(without)) - p and with_calls[-1 - s] == without[-1 - s]:
        s += 1
    return with_calls[p:len(with_calls) - s].strip() or None


def stop_token_ids(chat: ChatFormat, extra: list[str]) -> list[int]:
    """The target's stop tokens (specdistill/data/chat.py) and the `stop` token strings."""
    ids, vocab = set(chat.stop_ids), chat.tokenizer.get_vocab()
    for token in extra:
        if token not in vocab:
            raise ValueError(f"stop={token!r} is not a token of the target's tokenizer")
        ids.add(vocab[token])
    return sorted(ids)


def read_prompts(path: Path, chat: ChatFormat | None, turns: str = "last") -> list[Dialogue]:
    """Every input row as a Dialogue (small files: tools and tests)."""
    out = [dialogue(row_id, obj, at, chat, turns) for row_id, obj, at in iter_rows(Path(path))]
    if not out:
        raise ValueError(f"{path}: no prompts")
    return out


# ---- the output: shards, what is written, who wrote it ----------------------------------------------------------
def parse_shard(shard: str | None) -> tuple[int, int] | None:
    if shard is None:
        return None
    m = re.fullmatch(r"(\d+)/(\d+)", str(shard))
    if not m or not int(m.group(1)) < int(m.group(2)):
        raise ValueError(f"shard={shard!r}: expected I/N with 0 <= I < N (shard=0/4 ... shard=3/4 for 4 GPUs)")
    return int(m.group(1)), int(m.group(2))


def shard_path(output: str | Path, shard: tuple[int, int] | None) -> Path:
    """OUTPUT itself, or its shard file: train.jsonl -> train.shard-2-of-4.jsonl."""
    output = Path(output)
    return output if shard is None else output.with_name(f"{output.stem}.shard-{shard[0]}-of-{shard[1]}{output.suffix}")


def record_path(output: Path) -> Path:
    return output.with_name(output.name + ".regenerate.json")


class Written:
    """What an earlier run wrote to an output: (id, turn, last, byte offset) per complete row, read from each line's
    `{"id": N, "turn": K, "last": B,` prefix and its end, so a multi-GB output is indexed at disk speed. A torn last
    line (a crash mid-write) is cut off."""

    def __init__(self, path: Path, cut: bool = True):
        self.path, ids, turns, last, offsets, lengths = path, [], [], [], [], []
        size = 0
        if path.is_file():
            with path.open("rb") as f:
                for line in f:
                    m = _ROW_PREFIX.match(line)
                    if not (m and line.endswith(b"}\n")):
                        break
                    ids.append(int(m.group(1)))
                    turns.append(int(m.group(2)))
                    last.append(m.group(3) == b"true")
                    offsets.append(size)
                    lengths.append(len(line))
                    size += len(line)
            if size < path.stat().st_size:
                if not cut:
                    raise ValueError(f"{path}: a torn row at byte {size} (a run stopped mid-write); re-run it")
                log.warning("%s: cutting a torn last row at byte %d (a run stopped mid-write)", path, size)
                os.truncate(path, size)
        self.ids, self.turns = np.array(ids, np.int64), np.array(turns, np.int64)
        self.last, self.offsets = np.array(last, bool), np.array(offsets, np.int64)
        self.lengths = np.array(lengths, np.int64)
        self._done = np.sort(self.ids[self.last])
        partial = np.flatnonzero(~np.isin(self.ids, self._done))
        self._partial: dict[int, dict[int, int]] = {}
        for i in partial:
            self._partial.setdefault(int(self.ids[i]), {})[int(self.turns[i])] = int(self.offsets[i])

    def __len__(self) -> int:
        return len(self.ids)

    def done(self, row_id: int) -> bool:
        k = int(np.searchsorted(self._done, row_id))
        return k < len(self._done) and self._done[k] == row_id

    def turns_of(self, row_id: int) -> dict[int, int]:
        """turn -> byte offset of the rows written for a conversation not finished."""
        return self._partial.get(row_id, {})

    def response(self, offset: int) -> list[int]:
        with self.path.open("rb") as f:
            f.seek(offset)
            row = json.loads(f.readline())
        return row["input_ids"][row["loss_mask"].index(1):] if 1 in row["loss_mask"] else []


def checkpoint_fingerprint(target_dir: Path) -> str:
    """config.json, the tokenizer's files, and per weight file its name, size and the sha256 of its first and last
    MiB: a sample (hashing hundreds of GB at every start is not an option) that changes with any retraining."""
    h = hashlib.sha256((target_dir / "config.json").read_bytes() + tokenizer_digest(target_dir).encode())
    for f in sorted({p for pattern in _WEIGHTS for p in target_dir.glob(pattern)}):
        size = f.stat().st_size
        with f.open("rb") as fh:
            head = fh.read(_SAMPLE_BYTES)
            fh.seek(max(0, size - _SAMPLE_BYTES))
            tail = fh.read(_SAMPLE_BYTES)
        h.update(f"{f.name}:{size}:".encode() + hashlib.sha256(head + tail).digest())
    return h.hexdigest()[:16]


def identity(cfg: RegenerateSettings, target_dir: Path, memo_dir: Path | None) -> dict:
    """What an output is written from: its input's bytes, the target, the settings that change rows, the shard."""
    path = Path(cfg.input)
    if memo_dir is not None:
        digest = content_digest(path, memo_dir)
    else:
        with path.open("rb") as f:
            digest = hashlib.file_digest(f, "sha256").hexdigest()
    settings = {k: getattr(cfg, k) for k in RESUME_SETTINGS}
    return {"input": {"path": str(path), "sha256": digest[:16]},
            "target": {"path": str(target_dir), "fingerprint": checkpoint_fingerprint(target_dir)},
            "settings": json.loads(json.dumps(settings, default=str)), "shard": cfg.shard}


def identity_difference(recorded: dict, now: dict) -> str | None:
    """What differs between an output's record and this run, in words (None: the same)."""
    if recorded["input"]["sha256"] != now["input"]["sha256"]:
        return (f"another input: it was written from {recorded['input']['path']} (sha256 "
                f"{recorded['input']['sha256']}), this run reads {now['input']['path']} (sha256 {now['input']['sha256']})")
    if recorded["target"]["fingerprint"] != now["target"]["fingerprint"]:
        return (f"another target: it was written by {recorded['target']['path']} (fingerprint "
                f"{recorded['target']['fingerprint']}), this run's is {now['target']['path']} (fingerprint "
                f"{now['target']['fingerprint']})")
    differ = [f"{k}={recorded['settings'].get(k)!r} there, {now['settings'].get(k)!r} now"
              for k in RESUME_SETTINGS if recorded["settings"].get(k) != now["settings"].get(k)]
    if differ:
        return f"other settings: {'; '.join(differ)}"
    if recorded.get("shard") != now.get("shard"):
        return f"another shard: shard={recorded.get('shard')} there, shard={now.get('shard')} now"
    return None


def check_resume(output: Path, now: dict) -> dict:
    """The output's record, written for a new output; a ValueError when the output was written from another input,
    target, settings or shard (saying which), or by something that left no record."""
    record = record_path(output)
    has_rows = output.is_file() and output.stat().st_size > 0
    if has_rows and not record.is_file():
        raise ValueError(f"{output}: has rows but no {record.name}: written by another tool or an older "
                         "specdistill-regenerate, so a resume cannot tell what from; pass another output= (or "
                         "remove the file)")
    if has_rows:
        saved = json.loads(record.read_text())
        why = identity_difference(saved, now)
        if why:
            raise ValueError(f"{output}: written from {why}. Resume with the same input, target and settings, or "
                             f"pass another output= (or remove {output} and {record.name})")
        return saved
    saved = {**now, "complete": False}
    _write_json(record, saved)
    return saved


@contextmanager
def sole_writer(output: Path):
    """Hold the output's lock for the block: a second process writing the same output is refused, naming the first."""
    try:
        with build_lock(output, wait=False, what="writing"):
            yield
    except LockHeld as e:
        raise ValueError(f"{e}: two writers of one output would write its rows twice; wait for it to finish, or "
                         "give each process its own shard=I/N") from None


def _write_json(path: Path, obj: dict) -> None:
    tmp = scratch_name(path, "tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    os.replace(tmp, path)


class _Writer:
    """Appends one output row per finished turn, flushed at once (a kill -9 loses nothing written)."""

    def __init__(self, path: Path, tokenizer, stop_ids: list[int]):
        path.parent.mkdir(parents=True, exist_ok=True)
        self._f, self._tok, self._stops = path.open("a"), tokenizer, set(stop_ids)
        self.rows, self.response_tokens = 0, 0
        self.started, self.first_row_at = time.perf_counter(), None

    def write(self, d: Dialogue, turn: int, prompt: list[int], response: list[int]) -> None:
        reason = "stop" if response and response[-1] in self._stops else "length"
        row = {"id": d.row_id, "turn": turn, "last": d.finished, "input_ids": prompt + response,
               "loss_mask": [0] * len(prompt) + [1] * len(response),
               "response_text": self._tok.decode(response), "finish_reason": reason}
        if d.ended:
            row["ended"] = d.ended
        if d.stage is not None:
            row["stage"] = d.stage
        self._f.write(json.dumps(row) + "\n")
        self._f.flush()
        if self.first_row_at is None:
            self.first_row_at = time.perf_counter()
        self.rows += 1
        self.response_tokens += len(response)

    def close(self) -> None:
        self._f.close()


# ---- the run ------------------------------------------------------------------------------------------------------
@dataclass
class _Counts:
    rows_before: int = 0  # rows an earlier run wrote
    conversations: int = 0
    resumed: int = 0  # conversations whose every turn an earlier run wrote
    too_long: list = field(default_factory=list)  # (row id, turn) whose prompt leaves no room
    tool_call_differs: int = 0


def regenerate(target_dir: Path, cfg: RegenerateSettings, memo_dir: Path | None = None) -> dict:
    """Regenerate cfg.input into cfg.output (or its shard file); `memo_dir` memoises the input's digest."""
    from transformers import AutoConfig

    if cfg.turns not in TURNS:
        raise ValueError(f"turns={cfg.turns!r}; valid: {', '.join(TURNS)}")
    shard = parse_shard(cfg.shard)
    backend = resolve_backend(cfg.backend)
    chat = ChatFormat.load(target_dir, cfg.chat_template_kwargs)
    context = AutoConfig.from_pretrained(str(target_dir)).get_text_config().max_position_embeddings
    limit = max_row_tokens(context)  # the longest row training takes whole
    stop_ids = stop_token_ids(chat, list(cfg.stop))
    settings = GenerationSettings(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
                                  batch_size=cfg.batch_size, seed=cfg.seed)
    out_path = shard_path(cfg.output, shard)
    with sole_writer(out_path):
        record = check_resume(out_path, identity(cfg, target_dir, memo_dir))
        written = Written(out_path)
        if len(written):
            log.info("%s: %d rows already written; resuming after them", out_path, len(written))
        counts = _Counts(rows_before=len(written))
        todo = _Todo(_dialogues(cfg, chat, shard, written, counts), counts, limit, context, cfg.input)
        writer, t0 = _Writer(out_path, chat.tokenizer, stop_ids), time.perf_counter()
        try:
            if backend == "vllm":
                _run_vllm(target_dir, todo, settings, stop_ids, context, cfg, writer)
            else:
                _run_hf(target_dir, todo, settings, stop_ids, cfg, writer)
        finally:
            writer.close()
        summary = _summary(backend, writer, counts, out_path, time.perf_counter() - t0, cfg, context)
        _write_json(record_path(out_path), {**record, "complete": True, "summary": summary})
    log.info("regenerate: %s", json.dumps(summary))
    return summary


def _dialogues(cfg, chat: ChatFormat, shard, written: Written, counts: _Counts) -> Iterator[Dialogue]:
    """The input's conversations still to regenerate, each after the turns an earlier run wrote (replayed)."""
    keep = None if shard is None else (lambda row_id: row_id % shard[1] == shard[0])
    for row_id, obj, at in iter_rows(Path(cfg.input), keep):
        counts.conversations += 1
        if written.done(row_id):
            counts.resumed += 1
            continue
        d = dialogue(row_id, obj, at, chat, cfg.turns)
        done = written.turns_of(row_id)
        while not d.finished and d.turn in done:
            d.answer(written.response(done[d.turn]))
        if d.finished:
            counts.resumed += 1
            continue
        yield d


class _Todo:
    """The requests to generate, in order: the next turn of a conversation whose turn just finished first, then
    the next conversation of the input. An iterator that may run dry and fill again (VLLMGenerator.stream asks
    again after each finished request)."""

    def __init__(self, dialogues: Iterator[Dialogue], counts: _Counts, limit: int, context: int, source: str):
        self._new, self._again, self.counts = dialogues, deque(), counts
        self.limit, self.context, self.source = limit, context, source

    def __iter__(self):
        return self

    def __next__(self) -> tuple[Dialogue, list[int]]:
        while True:
            d = self._again.popleft() if self._again else next(self._new)  # StopIteration: dry for now
            prompt = d.prompt()
            if len(prompt) < self.limit:
                return d, prompt
            self.counts.too_long.append((d.row_id, d.turn))
            log.warning("%s, row %d, turn %d: %d prompt tokens leave no room in the target's %d-token context "
                        "(max_position_embeddings; rows of at most %d tokens); the conversation ends here",
                        self.source, d.row_id, d.turn, len(prompt), self.context, self.limit)

    def again(self, d: Dialogue) -> None:
        if not d.finished:
            self._again.append(d)


def _seed(d: Dialogue) -> int:
    return d.row_id * 1009 + d.turn + 1  # per conversation and turn, so a sampled turn does not depend on its batch


def _answered(d: Dialogue, prompt: list[int], response: list[int], writer: _Writer, todo: _Todo) -> None:
    turn = d.turn
    d.answer(response)
    if d.ended == "tool_call_differs":
        todo.counts.tool_call_differs += 1
    writer.write(d, turn, prompt, response)
    todo.again(d)


def _run_vllm(target_dir, todo: _Todo, settings, stop_ids: list[int], context: int, cfg, writer: _Writer) -> None:
    prompts: dict[int, tuple[Dialogue, list[int]]] = {}

    class Requests:
        def __iter__(self):
            return self

        def __next__(self) -> Request:
            d, prompt = next(todo)
            prompts[id(d)] = (d, prompt)
            return Request(id(d), prompt, min(settings.max_new_tokens, todo.limit - len(prompt)), _seed(d))

    with VLLMGenerator(target_dir, cfg.dtype, settings.seed, max_model_len=context) as engine:
        for key, response in engine.stream(Requests(), settings, stop_ids):
            d, prompt = prompts.pop(key)
            _answered(d, prompt, response, writer, todo)


def _run_hf(target_dir, todo: _Todo, settings, stop_ids: list[int], cfg, writer: _Writer) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(target_dir), local_files_only=True, dtype="auto" if cfg.dtype is None else getattr(torch, cfg.dtype)).eval()
    pad = model.config.pad_token_id or 0
    while True:  # a window of conversations, one turn of each per round, until all of them finished
        window = [r for _, r in zip(range(settings.batch_size * HF_WINDOW), todo)]
        if not window:
            return
        _hf_round(model, window, settings, pad, stop_ids, writer, todo)


def _hf_round(model, window: list[tuple[Dialogue, list[int]]], settings, pad: int, stop_ids: list[int],
              writer: _Writer, todo: _Todo) -> None:
    """One turn of each conversation in the window, by response cap (prompts near the row limit get less room),
    written batch by batch."""
    from dataclasses import replace

    caps = [min(settings.max_new_tokens, todo.limit - len(p)) for _, p in window]
    for cap in sorted(set(caps)):
        group = [w for w, c in zip(window, caps) if c == cap]
        for start in range(0, len(group), settings.batch_size):
            batch = group[start:start + settings.batch_size]
            responses = generate(model, [p for _, p in batch], replace(settings, max_new_tokens=cap), pad,
                                 stop_ids, seeds=[_seed(d) for d, _ in batch])
            for (d, prompt), response in zip(batch, responses):
                _answered(d, prompt, response, writer, todo)


def _summary(backend: str, writer: _Writer, counts: _Counts, out_path: Path, seconds: float, cfg, context) -> dict:
    if counts.conversations == 0:
        raise ValueError(f"{cfg.input}: no prompts" + (f" in shard {cfg.shard}" if cfg.shard else ""))
    if writer.rows == 0 and counts.resumed == 0 and len(counts.too_long) == counts.conversations:
        raise ValueError(f"{cfg.input}: every prompt is longer than the target's context ({context} tokens)")
    first = (writer.first_row_at or time.perf_counter()) - writer.started  # model load / engine start
    return {"backend": backend, "rows_written": writer.rows, "rows_already_written": counts.rows_before,
            "conversations": counts.conversations, "conversations_already_written": counts.resumed,
            "rows_skipped_too_long": len(counts.too_long),
            "conversations_ended_at_a_differing_tool_call": counts.tool_call_differs, "output": str(out_path),
            "seconds": round(seconds, 1), "rows_per_s": round(writer.rows / max(seconds, 1e-9), 2),
            "first_row_seconds": round(first, 1),
            "rows_per_s_after_first": round((writer.rows - 1) / max(seconds - first, 1e-9), 2),
            "response_tokens": writer.response_tokens}


# ---- merging shards -----------------------------------------------------------------------------------------------
def merge_shards(output: str | Path, shards: int) -> dict:
    """Write OUTPUT from its `shards` finished shard files, rows in input order (id, then turn), with its record."""
    output = Path(output)
    if shards < 1:
        raise ValueError(f"merge={shards}: the number of shards (N of shard=I/N)")
    parts = [shard_path(output, (i, shards)) for i in range(shards)]
    records = []
    for i, part in enumerate(parts):
        record = record_path(part)
        if not record.is_file():
            raise ValueError(f"merge={shards}: no {record} (shard {i}/{shards} never ran there); run "
                             f"specdistill-regenerate ... shard={i}/{shards} first")
        records.append(json.loads(record.read_text()))
        if not records[-1].get("complete"):
            raise ValueError(f"merge={shards}: shard {i}/{shards} ({part}) is not finished; re-run it "
                             f"(specdistill-regenerate ... shard={i}/{shards}: it resumes)")
    for i, r in enumerate(records[1:], 1):
        why = identity_difference({**r, "shard": None}, {**records[0], "shard": None})
        if why:
            raise ValueError(f"merge={shards}: {parts[i]} was written from {why} than {parts[0]}")
    with sole_writer(output):
        index = [Written(p, cut=False) for p in parts]
        ids = np.concatenate([w.ids for w in index])
        turns = np.concatenate([w.turns for w in index])
        which = np.concatenate([np.full(len(w), i) for i, w in enumerate(index)])
        local = np.concatenate([np.arange(len(w)) for w in index])  # the row's place in its shard's index
        order = np.lexsort((turns, ids))
        twice = np.flatnonzero((np.diff(ids[order]) == 0) & (np.diff(turns[order]) == 0))
        if twice.size:
            j = order[twice[0]]
            raise ValueError(f"merge={shards}: row {ids[j]} turn {turns[j]} is in two shards")
        tmp = scratch_name(output, "merging")
        handles = [p.open("rb") for p in parts]
        try:
            with tmp.open("wb") as out:
                for j in order:
                    w, f, k = index[which[j]], handles[which[j]], local[j]
                    f.seek(int(w.offsets[k]))
                    out.write(f.read(int(w.lengths[k])))
            os.replace(tmp, output)
        finally:
            for f in handles:
                f.close()
            tmp.unlink(missing_ok=True)
        summary = {"merged": shards, "rows": int(len(order)), "output": str(output)}
        _write_json(record_path(output), {**records[0], "shard": None, "complete": True,
                                          "merged_from": [str(p) for p in parts], "summary": summary})
    log.info("regenerate merge: %s", json.dumps(summary))
    return summary


