"""On-policy regeneration of conversations (specdistill/data/regenerate.py): turns in order, each answered after the
history as the target answered it; a differing tool call ends its conversation; resumes refuse another input,
target or settings; shards merge in input order; a second writer is refused. A tiny Llama-3-format target fitted to
answers other than the recorded ones (tests/data/chat_families.py) makes every difference visible."""

import json
import shutil

import pytest

from specdistill.core.build_lock import build_lock
from specdistill.data.chat import ChatFormat
from specdistill.data.formats import load_rows
from specdistill.data.regenerate import reply_message, tool_call_text
from specdistill.launch.regenerate import parse, run
from tests.data.chat_families import build_tokenizer, tiny_target
from tests.files import write_jsonl

TOOLS = [{"type": "function", "function": {"name": "search", "description": "Search the catalogue",
                                           "parameters": {"type": "object", "properties": {
                                               "query": {"type": "string"}}, "required": ["query"]}}}]


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


def call(query):
    return {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "search", "arguments": {"query": query}}}]}


def tool(text):
    return {"role": "tool", "content": text}


# What the file records, and what the target answers (it was fitted to the latter).
RECORDED = [{"messages": [user("find red trail shoes"), assistant("Red ones here."), user("cheaper please"),
                          assistant("Cheaper ones here.")]},
            {"messages": [user("find tents"), call("tents"), tool('{"hits": 3}'), assistant("Found 3 tents.")],
             "tools": TOOLS, "stage": "search"},
            {"messages": [user("find lamps"), call("lamps"), tool('{"hits": 2}'), assistant("Found 2 lamps.")],
             "tools": TOOLS}]
SERVED = [{"messages": [user("find red trail shoes"), assistant('{"query": "red trail shoes"}'),
                        user("cheaper please"), assistant('{"query": "red trail shoes", "max": 60}')]},
          {"messages": [user("find tents"), call("camping tents")], "tools": TOOLS},  # another call than recorded
          RECORDED[2]]  # the same call: the conversation goes on


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    root = tmp_path_factory.mktemp("regen")
    draft = ChatFormat.load(build_tokenizer("llama3", root / "draft", [json.dumps(r) for r in RECORDED]))
    # BPE trained on the rendered conversations (the template's tool instructions included): short sequences, a
    # fast fit
    texts = [draft.render(draft.normalise(r["messages"]), r.get("tools"), False) for r in RECORDED + SERVED]
    tok_dir = build_tokenizer("llama3", root / "target", texts, vocab_size=1000)
    chat = ChatFormat.load(tok_dir)
    rows, _ = load_rows(write_jsonl(root / "served.jsonl", SERVED), chat, 10**6)
    target = tiny_target(tok_dir, [(list(r.input_ids), r.loss_mask.index(1)) for r in rows], steps=800)
    return target, rows


def regen(target_dir, src, out, *extra):
    return run(parse([f"target.path={target_dir}", f"input={src}", f"output={out}", "backend=hf",
                      "max_new_tokens=40", *extra]))


def read(out):
    return sorted((json.loads(line) for line in out.read_text().splitlines()), key=lambda r: (r["id"], r["turn"]))


def test_turns_are_regenerated_in_order_after_the_history_as_the_target_answered(target, tmp_path):
    target_dir, served = target
    src = write_jsonl(tmp_path / "recorded.jsonl", RECORDED)
    out = tmp_path / "out.jsonl"
    summary = regen(target_dir, src, out)
    rows = read(out)
    # Conversation 0: turn 3's prompt holds the target's own turn 1, not the recorded one: the served rows.
    # Conversation 1: the target calls search("camping tents"), the file's tool result answers search("tents"):
    # it ends there. Conversation 2: the same call, so the recorded tool result follows and turn 3 is regenerated.
    assert [(r["id"], r["turn"], r["last"]) for r in rows] == [(0, 1, False), (0, 3, True), (1, 1, True),
                                                                (2, 1, False), (2, 3, True)]
    assert [r["input_ids"] for r in rows] == [list(r.input_ids) for r in served]
    assert rows[2]["ended"] == "tool_call_differs" and rows[2]["stage"] == "search"
    assert summary["conversations_ended_at_a_differing_tool_call"] == 1 and summary["rows_written"] == 5
    # turns=last: one turn per conversation, after the recorded history
    last = tmp_path / "last.jsonl"
    regen(target_dir, src, last, "turns=last")
    chat = ChatFormat.load(target_dir)
    assert [(r["id"], r["turn"]) for r in read(last)] == [(0, 3), (1, 3), (2, 3)]
    prompt = chat.prompt_ids(RECORDED[0]["messages"][:3])
    assert read(last)[0]["input_ids"][:len(prompt)] == prompt and read(last)[0]["loss_mask"].index(1) == len(prompt)

    # A run stopped after conversation 0's first turn resumes from its row: the rest equals the whole run.
    lines = out.read_text().splitlines(keepends=True)
    keep = [ln for ln in lines if (json.loads(ln)["id"], json.loads(ln)["turn"]) in {(0, 1), (2, 1)}]
    out.write_text("".join(keep))
    summary = regen(target_dir, src, out)
    assert summary["rows_already_written"] == 2 and summary["rows_written"] == 3 and read(out) == rows

    # A resume from another input, target or settings is refused, saying which.
    with pytest.raises(ValueError, match=r"out.jsonl: written from other settings: max_new_tokens=40 there, 8 now"):
        run(parse([f"target.path={target_dir}", f"input={src}", f"output={out}", "backend=hf", "max_new_tokens=8"]))
    other = write_jsonl(tmp_path / "other.jsonl", RECORDED[:2])
    with pytest.raises(ValueError, match=r"written from another input: it was written from .*recorded.jsonl"):
        regen(target_dir, other, out)
    moved = tmp_path / "other-target"
    shutil.copytree(target_dir, moved)
    config = json.loads((moved / "config.json").read_text())
    (moved / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-5}))
    with pytest.raises(ValueError, match=r"written from another target: it was written by .*target \(fingerprint"):
        regen(moved, src, out)
    with build_lock(out, what="writing"):  # another process writing it
        with pytest.raises(ValueError, match=r"out.jsonl: another process is writing it \(host .*pid \d+.*two writers"):
            regen(target_dir, src, out)


def test_shards_regenerate_one_file_and_merge_in_input_order(target, tmp_path):
    target_dir, _ = target
    src = write_jsonl(tmp_path / "recorded.jsonl", RECORDED * 2)
    whole = tmp_path / "whole.jsonl"
    regen(target_dir, src, whole)
    out = tmp_path / "train.jsonl"
    regen(target_dir, src, out, "shard=1/2")
    with pytest.raises(ValueError, match=r"merge=2: no .*train.shard-0-of-2.jsonl.regenerate.json \(shard 0/2"):
        run(parse([f"output={out}", "merge=2"]))
    regen(target_dir, src, out, "shard=0/2")
    assert {r["id"] % 2 for r in read(tmp_path / "train.shard-1-of-2.jsonl")} == {1}
    summary = run(parse([f"output={out}", "merge=2"]))
    merged = [json.loads(line) for line in out.read_text().splitlines()]
    assert merged == read(whole) and summary["rows"] == len(merged) == 10  # in input order: (id, turn)
    assert json.loads((tmp_path / "train.jsonl.regenerate.json").read_text())["complete"]


def test_a_tool_call_in_other_words_keeps_the_recorded_call(tmp_path):
    """The recorded call's text as the template renders it, found in the target's turn among other text: the
    history keeps the recorded call, and the rest of the text is the message's content."""
    tok_dir = build_tokenizer("llama3", tmp_path / "tok", [json.dumps(r) for r in RECORDED])
    chat = ChatFormat.load(tok_dir)
    before = chat.normalise(RECORDED[1]["messages"][:1])
    recorded = chat.normalise(RECORDED[1]["messages"][:2])[1]
    text = tool_call_text(chat, before, recorded, TOOLS)
    assert text == '{"name": "search", "parameters": {"query": "tents"}}'
    eot = chat.tokenizer.convert_tokens_to_ids("<|eot_id|>")
    message = reply_message(chat, before, recorded, chat.encode("Let me look. " + text) + [eot], TOOLS)
    assert message["content"] == "Let me look." and message["tool_calls"] == recorded["tool_calls"]
    assert reply_message(chat, before, recorded, chat.encode(text.replace("tents", "lamps")) + [eot], TOOLS) is None



@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_a_tool_call_where_none_was_recorded_ends_the_conversation_when_a_turn_follows(family, tmp_path):
    """Turn 1 was recorded as text, and the user answered it; a target that calls search() there (in its family's
    call format) has no tool result to read next: the conversation ends at that turn. Text alone goes on; at the
    last turn nothing follows."""
    from specdistill.data.formats import Where
    from specdistill.data.regenerate import dialogue, unrecorded_call
    from tests.data.chat_families import END_OF_TURN

    chat = ChatFormat.load(build_tokenizer(family, tmp_path / "tok", [json.dumps(r) for r in RECORDED]))
    row = {"messages": RECORDED[0]["messages"], "tools": TOOLS}
    before = chat.normalise(row["messages"][:1])
    eot = [chat.tokenizer.convert_tokens_to_ids(END_OF_TURN[family])]
    text = tool_call_text(chat, before, chat.normalise([call("red trail shoes")])[0], TOOLS)
    calling, talking = chat.encode(text) + eot, chat.encode("Red ones here, and blue.") + eot
    assert unrecorded_call(chat, before, calling, TOOLS) and not unrecorded_call(chat, before, talking, TOOLS)
    assert not unrecorded_call(chat, before, calling, None)  # no tools offered: no call to find
    other = chat.encode(text.replace('"search"', '"searching"')) + eot  # not a tool of the row
    assert not unrecorded_call(chat, before, other, TOOLS)
    # Tools named like the template's own text ('{"name": ...', '<tool_call>'): only a call to them is one.
    for name in ("a", "tool", "name"):
        tools = [{"type": "function", "function": {**TOOLS[0]["function"], "name": name}}]
        probe = {"role": "assistant", "content": None,
                 "tool_calls": [{"type": "function", "function": {"name": name, "arguments": {"query": "x"}}}]}
        called = chat.encode(tool_call_text(chat, before, chat.normalise([probe])[0], tools)) + eot
        json_answer = chat.encode('Here: {"name": "Bob", "tool": "drill"}') + eot
        assert unrecorded_call(chat, before, called, tools), name
        assert not unrecorded_call(chat, before, json_answer, tools), name

    def answered(*responses):
        d = dialogue(0, row, Where(tmp_path / "in.jsonl", 0), chat, "all")
        for response in responses:
            d.answer(response)
        return d

    assert answered(calling).ended == "tool_call_differs" and answered(calling).finished
    d = answered(talking, calling)  # text at turn 1, a call at the last turn: both written, none ended
    assert d.ended is None and d.finished and d.history[1]["content"] == "Red ones here, and blue."
