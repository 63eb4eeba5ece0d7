"""Synthetic workload rows (stages, shapes, token budget) and make_workload's pre-tokenized output."""

import json
from collections import Counter

import numpy as np
import pytest

from specdistill.data.formats import load_rows
from specdistill.data import synthetic as mw
from specdistill.launch.targets import make_target
from specdistill.launch.tokenizer import as_hf, workload_tokenizer
from specdistill.data.workload import CALLS_PER_MESSAGE, STAGE_CALLS, STAGES, generate_rows


@pytest.fixture(scope="module")
def tok():
    return as_hf(workload_tokenizer())


def _n_tokens(tok, text):
    return len(tok(text, add_special_tokens=False)["input_ids"])


def test_rows_are_chat_shaped_and_follow_the_call_schedule():
    rows = generate_rows(2 * CALLS_PER_MESSAGE, seed=3)
    assert CALLS_PER_MESSAGE == 26 and set(STAGES) == {"context_parsing", "preference_extraction",
                                                        "search_queries", "filter_selection", "answer_writing"}
    schedule = [s for s, n in STAGE_CALLS.items() for _ in range(n)]
    assert [r["stage"] for r in rows[:26]] == schedule
    assert len({r["id"] for r in rows}) == len(rows)
    for r in rows:
        assert [m["role"] for m in r["messages"]] == ["system", "user", "assistant"]
        assert all(isinstance(m["content"], str) and m["content"] for m in r["messages"])
        if r["stage"] != "answer_writing":
            json.loads(r["messages"][-1]["content"])  # JSON stages answer in valid JSON


def test_deterministic_and_splits_are_disjoint():
    assert generate_rows(30, seed=1) == generate_rows(30, seed=1)
    train, held = generate_rows(30, seed=1), generate_rows(30, seed=1, split="heldout")
    assert {r["messages"][1]["content"] for r in train}.isdisjoint(r["messages"][1]["content"] for r in held)


def test_response_budget_matches_the_mission(tok):
    rows = generate_rows(10 * CALLS_PER_MESSAGE, seed=0)
    per_stage = Counter()
    for r in rows:
        per_stage[r["stage"]] += _n_tokens(tok, r["messages"][-1]["content"]) + 1  # + <|im_end|>
    total = sum(per_stage.values())
    assert 38 <= total / len(rows) <= 55  # ~45 tokens per response
    assert 0.55 <= (per_stage["filter_selection"] + per_stage["search_queries"]) / total <= 0.67  # ~60%


@pytest.mark.parametrize("prompt_tokens", [200, 400, 1200])
def test_prompt_length_tracks_target(tok, prompt_tokens):
    rows = generate_rows(26, seed=0, prompt_tokens=prompt_tokens, count_tokens=lambda s: _n_tokens(tok, s))
    lengths = [_n_tokens(tok, tok.apply_chat_template(r["messages"][:-1], tokenize=False,
                                                      add_generation_prompt=True)) for r in rows]
    assert prompt_tokens <= sum(lengths) / len(lengths) <= prompt_tokens * 1.25


@pytest.fixture(scope="module")
def workload(tmp_path_factory):
    root = tmp_path_factory.mktemp("workload")
    target = make_target("tiny-qwen3-next", root / "target", fit_steps=0)
    train, held = mw.make_workload(target, root / "data", rows=3, heldout=2, max_new_tokens=6, prompt_tokens=120,
                                   backend="hf")
    return target, train, held


def test_make_workload_writes_pretokenized_rows(workload, tok):
    target, train, held = workload
    rows = [json.loads(ln) for ln in train.read_text().splitlines()]
    held_rows = [json.loads(ln) for ln in held.read_text().splitlines()]
    assert len(rows) == 3 and len(held_rows) == 2
    assert {r["id"] for r in rows}.isdisjoint(r["id"] for r in held_rows)
    for r in rows + held_rows:
        assert set(r) == {"id", "stage", "input_ids", "loss_mask", "prompt_text", "response_text"}
        prompt = tok(r["prompt_text"], add_special_tokens=False)["input_ids"]
        n_resp = len(r["input_ids"]) - len(prompt)
        assert r["input_ids"][: len(prompt)] == prompt and 1 <= n_resp <= 6
        assert r["loss_mask"] == [0] * len(prompt) + [1] * n_resp
        assert r["prompt_text"].endswith("<|im_start|>assistant\n")
    loaded, report = load_rows(train, tok, max_tokens=4096)  # the dataset loader reads it as-is
    assert len(loaded) == 3 and report.skipped == 0
    assert json.loads((train.parent / "workload_meta.json").read_text())["rows_per_s"] > 0


def test_generated_eos_is_kept_in_the_loss_mask(tok, monkeypatch):
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    row = generate_rows(1, seed=0)[0]
    monkeypatch.setattr(mw, "respond", lambda *args, **kw: [[11, 12, eos]])  # the target, scripted
    (out,) = mw._replay("unused", tok, [row], max_new_tokens=8, backend="hf", desc="t")
    assert out["input_ids"][-3:] == [11, 12, eos] and out["loss_mask"][-4:] == [0, 1, 1, 1]
    assert sum(out["loss_mask"]) == 3 and "<|im_end|>" not in out["response_text"]


def test_prompt_spread_draws_lengths_around_the_median(tok):
    """Mission-shaped prompts: lognormal lengths around prompt_tokens (what lets packs fill), clipped to 3x."""
    count = lambda s: _n_tokens(tok, s)
    rows = generate_rows(60, seed=0, prompt_tokens=600, count_tokens=count, prompt_spread=0.3)
    lengths = np.array([count(tok.apply_chat_template(r["messages"][:-1], tokenize=False, add_generation_prompt=True))
                        for r in rows])
    spread = np.log(lengths).std()
    assert 500 <= np.median(lengths) <= 800 and 0.15 <= spread <= 0.45 and lengths.max() <= 3 * 600 * 1.2
    assert generate_rows(5, seed=0, prompt_tokens=600) == generate_rows(5, seed=0, prompt_tokens=600, prompt_spread=0)
