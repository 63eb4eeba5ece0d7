"""load_rows: the three row formats, loss masks, and every bad-input case (error or counted skip)."""

import json

import pytest
from transformers import LlamaConfig

from specdistill.data.formats import DatasetError, check_tokenizer_matches, load_rows
from specdistill.launch.tokenizer import as_hf, workload_tokenizer

SYSTEM = {"role": "system", "content": "Return JSON."}
USER = {"role": "user", "content": "black trail shoes under $120"}
ANSWER = '{"category": "running shoes", "price": {"max": 120}}'


@pytest.fixture(scope="module")
def tok():
    return as_hf(workload_tokenizer())


def _write(tmp_path, lines, name="rows.jsonl"):
    path = tmp_path / name
    path.write_text("".join((ln if isinstance(ln, str) else json.dumps(ln)) + "\n" for ln in lines))
    return path


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_chat_row_masks_only_the_response(tok, tmp_path):
    path = _write(tmp_path, [{"messages": [SYSTEM, USER, {"role": "assistant", "content": ANSWER}]}])
    (row,), report = load_rows(path, tok, max_tokens=4096)
    prompt = _ids(tok, tok.apply_chat_template([SYSTEM, USER], tokenize=False, add_generation_prompt=True))
    response = _ids(tok, ANSWER + "<|im_end|>")
    assert row.row_id == 0 and list(row.input_ids) == prompt + response
    assert list(row.loss_mask) == [0] * len(prompt) + [1] * len(response)
    assert row.input_ids[-1] == tok.convert_tokens_to_ids("<|im_end|>")
    assert report.rows_kept == 1 and report.skipped == 0


def test_prompt_response_row_is_a_single_user_turn(tok, tmp_path):
    path = _write(tmp_path, [{"prompt": USER["content"], "response": ANSWER},
                             {"messages": [USER, {"role": "assistant", "content": ANSWER}]}])
    (a, b), _ = load_rows(path, tok, max_tokens=4096)
    assert (a.input_ids, a.loss_mask) == (b.input_ids, b.loss_mask) and (a.row_id, b.row_id) == (0, 1)


def test_pretokenized_row_passes_through_and_row_id_is_its_position(tok, tmp_path):
    path = _write(tmp_path, ["", {"input_ids": [5, 6, 7, 8], "loss_mask": [0, 0, 1, 1], "id": "x"}])
    (row,), report = load_rows(path, tok, max_tokens=16)  # row ids are dense (the blank line 0 is no row)
    assert row.row_id == 0 and row.input_ids == (5, 6, 7, 8) and row.loss_mask == (0, 0, 1, 1)


@pytest.mark.parametrize("line, where", [
    ('{"messages": [', "line 1 (row 0): malformed JSON"),
    ({"prompt": "hi"}, "field 'response': expected a string (field missing)"),
    ({"prompt": "hi", "response": 3}, "field 'response': expected a string, got int 3"),
    ({"messages": [USER, {"role": "assistant", "content": 7}]}, "field 'messages[1].content': expected a string"),
    ({"messages": [USER, {"content": "x"}]}, "field 'messages[1].role'"),
    ({"messages": [{"role": "assistant", "content": "x"}]}, "field 'messages': expected an assistant message after"),
    ({"messages": [{"role": "assistant", "content": "x"}, USER]}, "expected an assistant message after the first"),
    ({"messages": "hello"}, "field 'messages'"),
    ({"input_ids": [1, 2], "loss_mask": [1]}, "field 'loss_mask': expected the same length as input_ids (2)"),
    ({"input_ids": [1, "2"], "loss_mask": [0, 1]}, "field 'input_ids': expected a list of ints"),
    ({"input_ids": [1, 2]}, "field 'loss_mask': expected a list of 0/1 beside input_ids (field missing)"),
    ({"input_ids": [1, 2], "loss_mask": [0, 2]}, "field 'loss_mask': expected a list of 0/1"),
    ({"text": "hi"}, "keys present: ['text']"),
    ([1, 2], "expected a JSON object"),
])
def test_bad_rows_name_file_line_and_field(tok, tmp_path, line, where):
    good = {"prompt": "a", "response": "b"}
    path = _write(tmp_path, [good, line])
    with pytest.raises(DatasetError) as e:
        load_rows(path, tok, max_tokens=4096)
    msg = str(e.value)
    assert str(path) in msg and where.replace("line 1 (row 0)", "line 2 (row 1)") in msg, msg
    assert "line 2 (row 1)" in msg, msg


def test_empty_and_too_long_rows_are_counted_skips(tok, tmp_path):
    lines = [{"prompt": "a", "response": "ok"},
             {"prompt": "a", "response": "  "},  # nothing to learn
             {"input_ids": [1, 2, 3], "loss_mask": [0, 0, 0]},  # no response tokens
             {"input_ids": list(range(100)), "loss_mask": [0] * 50 + [1] * 50},  # > max_tokens
             {"prompt": "a", "response": "ok"}]
    rows, report = load_rows(_write(tmp_path, lines), tok, max_tokens=64)
    assert [r.row_id for r in rows] == [0, 2]  # dense ids: rows with no response get none, too-long ones do
    assert report.counts == {"no_response_tokens": 2, "too_long": 1}
    assert report.examples == {"no_response_tokens": [1, 2], "too_long": [3]}
    summary = report.summary()
    assert "kept 2/5 rows" in summary and "too_long=1 (rows 3)" in summary and "\n" not in summary


def test_token_id_outside_vocab_names_the_row(tok, tmp_path):
    path = _write(tmp_path, [{"input_ids": [1, len(tok)], "loss_mask": [0, 1]}])
    with pytest.raises(DatasetError, match=r"line 1 \(row 0\).*tokenizer does not match the target's vocab"):
        load_rows(path, tok, max_tokens=64)


def test_check_tokenizer_matches(tok):
    check_tokenizer_matches(tok, LlamaConfig(vocab_size=len(tok)))
    check_tokenizer_matches(tok, {"text_config": {"vocab_size": len(tok) + 64}})  # padded tables are fine
    with pytest.raises(DatasetError, match="tokenizer does not match the target's vocab"):
        check_tokenizer_matches(tok, LlamaConfig(vocab_size=len(tok) - 1))
