"""Trained turns from the target's own chat template (specdistill/data/chat.py, formats.py), in six template families
built locally (tests/data/chat_families.py): for every assistant turn of a multi-turn conversation, the prompt is what
a chat server feeds the target and the response is what the target generates - a tiny target fitted to the family's
turns, generating greedily from the served prompt with the stop tokens specdistill derives, emits exactly the trained
tokens and ends on the family's published stop token (GLM's: the next message's header)."""

import json

import pytest

from specdistill.data.chat import ChatFormat, content_format
from specdistill.data.config import DataConfig
from specdistill.data.formats import DatasetError, load_rows
from specdistill.data.generate import GenerationSettings, respond
from specdistill.launch.regenerate import parse, run
from tests.data.chat_families import END_OF_TURN, ENDS_BY_NEXT_HEADER, STOP, build_tokenizer, tiny_target
from tests.files import write_jsonl

FAMILIES = ("qwen3", "llama3", "gemma", "llama2", "gpt-oss", "glm")
SYSTEM = {"role": "system", "content": "Return JSON for the shop's search API."}
# Template variables per family (data.chat_template_kwargs): gpt-oss's model identity, shorter than its default.
KWARGS = {"gpt-oss": {"model_identity": "Shop bot."}}


def conversations(family: str) -> list[list[dict]]:
    def user(text):
        return {"role": "user", "content": text}

    def assistant(text, **extra):
        return {"role": "assistant", "content": text, **extra}

    think = {"qwen3": "reasoning_content", "gpt-oss": "thinking", "glm": "reasoning_content"}.get(family)
    extra = {think: "The user wants shoes."} if think else {}
    convs = [[user("find red trail shoes"), assistant('{"query": "red trail shoes"}', **extra),
              user("cheaper please"), assistant('{"query": "red trail shoes", "max": 60}'),
              user("and in blue?"), assistant('{"query": "blue trail shoes", "max": 60}')],
             [user("a tent for two"), assistant('{"query": "tent", "people": 2}'),
              user("waterproof"), assistant('{"query": "tent", "people": 2, "waterproof": true}')]]
    if family != "gemma":  # Gemma's template has no system role
        convs[1].insert(0, SYSTEM)
    return convs


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    texts = {f: [json.dumps(c) for c in conversations(f)] for f in (*FAMILIES, "deepseek")}
    return {f: build_tokenizer(f, root / f, texts[f]) for f in texts}


def served(tok, messages, **kwargs) -> list[int]:
    """The independent reference for a prompt: apply_chat_template with the generation prompt, tokenized as a chat
    server does (no special tokens added)."""
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    return tok(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("family", FAMILIES)
def test_trained_turns_are_what_the_target_generates(family, family_dirs, tmp_path):
    tok_dir, kwargs = family_dirs[family], KWARGS.get(family, {})
    chat = ChatFormat.load(tok_dir, kwargs)
    tok = chat.tokenizer
    stops = {tok.convert_tokens_to_ids(t) for t in STOP[family]}
    assert chat.stop_ids == stops  # tokenizer eos + generation_config.json eos + the template's end of turn
    convs = conversations(family)
    rows, report = load_rows(write_jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in convs]), chat, 10**6,
                             DataConfig(chat_template_kwargs=kwargs))
    turns = [(c, k) for c in convs for k, m in enumerate(c) if m["role"] == "assistant"]
    assert len(rows) == len(turns) == 5 and report.rows_seen == 5 and report.lines_seen == 2
    assert [r.row_id for r in rows] == list(range(5))  # dense ids, a conversation's turns in order
    prompts, responses = [], []
    for row, (conv, k) in zip(rows, turns):
        prompt = served(tok, conv[:k], **kwargs)
        n = row.loss_mask.index(1)
        assert list(row.input_ids[:n]) == prompt and set(row.loss_mask[n:]) == {1}
        response = list(row.input_ids[n:])
        assert tok.convert_ids_to_tokens(response[-1]) == END_OF_TURN[family]
        assert not stops & set(response[:-1])  # up to and including the first stop token, nothing after
        assert conv[k]["content"] in tok.decode(response)
        prompts.append(prompt)
        responses.append(response)
    # A target fitted to the family's turns (each turn's full rendering, text after its stop token included; GLM's
    # followed by the user header that comes next), generating from the served prompt with the derived stop tokens:
    # token for token the trained response.
    ended = END_OF_TURN[family] if family in ENDS_BY_NEXT_HEADER else ""
    full = [tok(tok.apply_chat_template(c[:k + 1], tokenize=False, **kwargs) + ended, add_special_tokens=False)[
        "input_ids"] for c, k in turns]
    target = tiny_target(tok_dir, [(f, len(p)) for f, p in zip(full, prompts)])
    generated = respond(target, prompts, GenerationSettings(max_new_tokens=max(map(len, responses)) + 8),
                        sorted(chat.stop_ids), backend="hf")
    assert generated == responses
    # specdistill-regenerate renders the same prompts and stops on the same tokens, turn after turn, each after
    # the history as the target answered it (here: as recorded, which it reproduces): its rows are the trained rows.
    out = tmp_path / "regenerated.jsonl"
    run(parse([f"target.path={target}", f"input={tmp_path / 'chat.jsonl'}", f"output={out}", "backend=hf",
               "max_new_tokens=64", f"chat_template_kwargs={json.dumps(kwargs)}"]))
    written = sorted((json.loads(line) for line in out.read_text().splitlines()), key=lambda r: (r["id"], r["turn"]))
    assert [tuple(r["input_ids"]) for r in written] == [r.input_ids for r in rows]
    assert {r["finish_reason"] for r in written} == {"stop"} and [r["last"] for r in written].count(True) == 2


def test_qwen3_enable_thinking_false_puts_the_empty_think_block_in_the_prompt(family_dirs, tmp_path):
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": conversations("qwen3")[1]}])
    tok = ChatFormat.load(family_dirs["qwen3"]).tokenizer
    off = DataConfig(chat_template_kwargs={"enable_thinking": False})
    rows, _ = load_rows(path, ChatFormat.load(family_dirs["qwen3"], off.chat_template_kwargs), 10**6, off)
    default, _ = load_rows(path, tok, 10**6)

    def split(row):
        n = row.loss_mask.index(1)
        return tok.decode(row.input_ids[:n]), tok.decode(row.input_ids[n:])

    prompt, response = split(rows[0])
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert response == '{"query": "tent", "people": 2}<|im_end|>'
    assert split(default[0])[1] == '<think>\n\n</think>\n\n{"query": "tent", "people": 2}<|im_end|>'


@pytest.mark.parametrize("family, reasoning", [("qwen3", "reasoning_content"), ("gpt-oss", "thinking"),
                                               ("glm", "reasoning_content")])
def test_earlier_reasoning_is_dropped_from_later_prompts_as_served(family, reasoning, family_dirs, tmp_path):
    conv = conversations(family)[0]
    chat = ChatFormat.load(family_dirs[family])
    rows, _ = load_rows(write_jsonl(tmp_path / "chat.jsonl", [{"messages": conv}]), chat, 10**6)
    tok = chat.tokenizer
    first, second = (tok.decode(r.input_ids) for r in rows[:2])
    assert "The user wants shoes." in first  # turn 1 trains its own reasoning (the target generates it)
    assert "The user wants shoes." not in second  # turn 2's prompt is its history as served: reasoning dropped
    assert list(rows[1].input_ids[:rows[1].loss_mask.index(1)]) == served(tok, conv[:3])


TOOLS = [{"type": "function", "function": {"name": "search", "description": "Search the catalogue",
                                           "parameters": {"type": "object", "properties": {
                                               "query": {"type": "string", "description": "what to find"}},
                                               "required": ["query"]}}}]
TOOL_CONV = [{"role": "user", "content": "find tents"},
             {"role": "assistant", "content": None, "tool_calls": [
                 {"type": "function", "function": {"name": "search", "arguments": '{"query": "tents"}'}}]},
             {"role": "tool", "content": [{"type": "text", "text": '{"hits": 3}'}]},
             {"role": "assistant", "content": "Found 3 tents."}]


@pytest.mark.parametrize("family, call", [
    ("qwen3", '<tool_call>\n{"name": "search", "arguments": {"query": "tents"}}\n</tool_call><|im_end|>'),
    ("llama3", '{"name": "search", "parameters": {"query": "tents"}}<|eot_id|>'),
    ("glm", "\n<think></think>\n<tool_call>search\n<arg_key>query</arg_key>\n<arg_value>tents</arg_value>\n</tool_call>"
            "<|observation|>")])
def test_tool_calls_tool_results_and_tool_schemas_go_through_the_template(family, call, family_dirs, tmp_path):
    path = write_jsonl(tmp_path / "tools.jsonl", [{"messages": TOOL_CONV, "tools": TOOLS}])
    chat = ChatFormat.load(family_dirs[family], {"enable_thinking": False} if family == "qwen3" else {})
    rows, _ = load_rows(path, chat, 10**6, DataConfig(chat_template_kwargs=chat.kwargs))
    tok = chat.tokenizer
    prompt = tok.decode(rows[0].input_ids[:rows[0].loss_mask.index(1)])
    assert "Search the catalogue" in prompt  # the row's tools list is in the prompt
    assert tok.decode(rows[0].input_ids[rows[0].loss_mask.index(1):]) == call
    # the tool result (list content, joined as vLLM joins it) is in the final turn's prompt (Llama 3.1's template
    # writes a tool result through tojson)
    assert "hits" in tok.decode(rows[1].input_ids[:rows[1].loss_mask.index(1)])


def test_a_template_that_writes_no_end_of_turn_trains_the_header_that_ends_it(family_dirs, tmp_path):
    """GLM writes nothing after an assistant message: its target stops by emitting the next message's header, a stop
    id of its generation_config.json. A turn that calls a tool ends with <|observation|>, where the conversation goes
    on with the result and where it ends with the call; without the header among the stop tokens the row is refused,
    naming it."""
    chat = ChatFormat.load(family_dirs["glm"])
    tok = chat.tokenizer
    msgs = chat.normalise(TOOL_CONV)
    last = chat.turn(msgs[:2], 1, TOOLS)  # the conversation ends with the call: its result is what would follow
    assert last == chat.turn(msgs, 1, TOOLS) and tok.convert_ids_to_tokens(last.response[-1]) == "<|observation|>"
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": conversations("glm")[1]}])
    without = ChatFormat(tok, eos_ids=[tok.eos_token_id])  # a generation_config.json that lists <|endoftext|> only
    with pytest.raises(DatasetError, match=r"line 1 \(row 0\), field 'messages\[2\]': the chat template renders no "
                                           r"stop token .* the user message after it opens with '<\|user\|>', which "
                                           r"is not a stop token either .* generation_config.json's eos_token_id"):
        load_rows(path, without, 10**6)


def test_list_content_is_joined_for_string_templates_and_kept_for_part_templates(family_dirs):
    chat = ChatFormat.load(family_dirs["llama3"])
    parts = [{"type": "text", "text": "red"}, {"type": "text", "text": "shoes"}]
    (m,) = chat.normalise([{"role": "user", "content": parts}])
    assert chat.content_format == "string" and m["content"] == "red\nshoes"
    parts_template = "{% for m in messages %}{% for p in m['content'] %}{{ p['text'] }}{% endfor %}{% endfor %}"
    assert content_format(parts_template) == "openai"


def test_loss_on_last_and_sharegpt_rows(family_dirs, tmp_path):
    conv = conversations("llama3")[0]
    sharegpt = {"conversations": [{"from": {"user": "human", "assistant": "gpt"}[m["role"]], "value": m["content"]}
                                  for m in conv]}
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": conv}, sharegpt])
    tok_dir = family_dirs["llama3"]
    every, _ = load_rows(path, ChatFormat.load(tok_dir), 10**6)
    last, report = load_rows(path, ChatFormat.load(tok_dir), 10**6, DataConfig(loss_on="last"))
    assert len(every) == 6 and len(last) == 2 and report.rows_seen == 2
    assert every[2].input_ids == last[0].input_ids == last[1].input_ids  # ShareGPT reads as the same messages


def test_template_errors_name_file_line_and_message_and_skip_counts_them(family_dirs, tmp_path):
    good = {"messages": conversations("gemma")[0]}
    bad_roles = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                              {"role": "assistant", "content": "c"}]}
    rows = [good, {"messages": [SYSTEM, *conversations("gemma")[0]]}, good, bad_roles, "{not json"]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    chat = ChatFormat.load(family_dirs["gemma"])
    with pytest.raises(DatasetError, match=r"chat.jsonl, line 2 \(row 1\), field 'messages\[0\]': chat template "
                                           r"error: .*System role not supported"):
        load_rows(path, chat, 10**6)
    kept, report = load_rows(path, chat, 10**6, DataConfig(bad_rows="skip"))
    assert len(kept) == 6 and report.counts == {"bad_row": 3} and report.examples["bad_row"] == [1, 3, 4]
    assert "field 'messages[2]': chat template error" in report.errors[1]  # the message that breaks alternation
    assert "line 5 (row 4): malformed JSON" in report.errors[2] and "first errors" in report.summary()


def test_a_template_whose_prompt_is_not_a_prefix_of_the_turn_is_refused_naming_the_row(family_dirs, tmp_path):
    """DeepSeek-R1's generation prompt ends in <think>, which its rendering of a finished turn drops: the turn cannot
    be trained as served, and the error says so (data.bad_rows=skip would count it)."""
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": conversations("deepseek")[0]}])
    with pytest.raises(DatasetError, match=r"line 1 \(row 0\), field 'messages\[1\]': the chat template's prompt .* "
                                           r"is not a prefix of its rendering of the finished turn.*'<think>"):
        load_rows(path, ChatFormat.load(family_dirs["deepseek"]), 10**6)


@pytest.mark.parametrize("family", ["qwen3", "llama2"])  # byte-level and sentencepiece-style tokenizers
def test_a_token_merging_across_the_prompt_boundary_keeps_the_served_prompt(family, family_dirs):
    """A generation prompt ending mid-word ('sho' + 'es'): the tokenizer merges across the boundary, so the
    prompt's tokens are not a prefix of the turn's; the prompt stays as served, the response is the rest of the text
    tokenized as a continuation (no prefix space added), counted as retokenized."""
    tok = ChatFormat.load(family_dirs[family]).tokenizer
    end = tok.eos_token
    tok.chat_template = ("{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '" + end + "' }}{% endfor %}"
                         "{% if add_generation_prompt %}{{ 'assistant: sho' }}{% endif %}")
    chat = ChatFormat(tok)
    msgs = chat.normalise([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "shoes ok"}])
    text = f"user: hi{end}assistant: shoes ok{end}"
    whole = tok(text, add_special_tokens=False)["input_ids"]
    turn = chat.turn(msgs, 1)
    assert turn.prompt == served(tok, msgs[:1]) and whole[:len(turn.prompt)] != turn.prompt
    assert turn.retokenized and tok.decode(turn.prompt + turn.response) == tok.decode(whole) == text
    assert turn.response[-1] == tok.eos_token_id


def test_empty_assistant_turns_are_skipped_and_kwargs_that_specdistill_sets_are_refused(family_dirs, tmp_path):
    conv = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "  "},
            {"role": "user", "content": "b"}, {"role": "assistant", "content": "ok"}]
    rows, report = load_rows(write_jsonl(tmp_path / "c.jsonl", [{"messages": conv}]), ChatFormat.load(
        family_dirs["llama3"]), 10**6)
    assert len(rows) == 1 and report.counts == {"no_response_tokens": 1}
    with pytest.raises(ValueError, match="add_generation_prompt"):
        ChatFormat.load(family_dirs["llama3"], {"add_generation_prompt": True})
