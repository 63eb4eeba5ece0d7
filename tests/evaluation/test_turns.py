"""specdistill/evaluation/turns.py: recorded-turn format and generator, the replay scheduler (dependencies, pauses, users), ties,
and (vllm, slow) the whole benchmark against `vllm serve` with the tiny llama at U = 1 and 2."""

import json
import threading
import time

import pytest

from specdistill.evaluation.turn_format import Call, Turn, read_turns, split_messages, turns_from_rows, write_turns
from specdistill.evaluation.turns import Config, rank, replay_turn, run_users, table
from specdistill.data.workload import STAGE_CALLS


def fake_rows(messages=2, truncate_last=0, response=6):
    rows = []
    for m in range(messages):
        for stage, calls in STAGE_CALLS.items():
            for c in range(calls):
                rows.append({"id": f"r{len(rows)}", "stage": stage, "input_ids": [m, c, 7, 8, 9] + [1] * response,
                             "loss_mask": [0] * 5 + [1] * response})
    return rows[: len(rows) - truncate_last]


def test_turns_from_rows_one_turn_per_message_stage_after_stage():
    rows = fake_rows(messages=2) + fake_rows(messages=1, truncate_last=20)  # a third, truncated message
    assert [len(m) for m in split_messages(rows)] == [26, 26, 6]
    turns = turns_from_rows(rows, max_tokens=4, seed=1)
    assert len(turns) == 3 and len(turns[0].calls) == 26
    by_id = {c.id: c for c in turns[0].calls}
    assert by_id["context_parsing-0"].depends_on == []
    assert by_id["search_queries-3"].depends_on == [f"preference_extraction-{i}" for i in range(3)]
    assert by_id["answer_writing-0"].depends_on == [f"filter_selection-{i}" for i in range(7)]
    assert by_id["filter_selection-0"].expects_json and not by_id["answer_writing-0"].expects_json
    assert by_id["context_parsing-0"].prompt_token_ids == [0, 0, 7, 8, 9] and by_id["context_parsing-0"].max_tokens == 4
    assert all(0 <= c.pause_s <= 0.02 for c in turns[0].calls)
    assert turns_from_rows(rows, seed=1) != turns_from_rows(rows, seed=2)  # pauses are seeded


def test_turn_files_round_trip_and_bad_turns_are_named(tmp_path):
    turns = turns_from_rows(fake_rows(1))
    write_turns(turns, tmp_path / "t.jsonl")
    assert read_turns(tmp_path / "t.jsonl") == turns
    with pytest.raises(ValueError, match="turn x, call b: depends_on \\['c'\\]"):
        Turn("x", [Call("a", [1], 1), Call("b", [1], 1, depends_on=["c"]), Call("c", [1], 1)])
    (tmp_path / "bad.jsonl").write_text('{"turn_id": "x", "calls": [{"id": "a"}]}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1: not a recorded turn"):
        read_turns(tmp_path / "bad.jsonl")


def recording_send(service_s: float):
    """A fake endpoint: sleeps service_s per call, records (start, end) per call id, counts calls in flight."""
    log, lock, state = {}, threading.Lock(), {"in_flight": 0, "max_in_flight": 0}

    def send(call):
        with lock:
            state["in_flight"] += 1
            state["max_in_flight"] = max(state["max_in_flight"], state["in_flight"])
        t0 = time.perf_counter()
        time.sleep(service_s)
        with lock:
            state["in_flight"] -= 1
            log[call.id] = (t0, time.perf_counter())
        return '{"ok": true}' if call.expects_json else "prose"

    return send, log, state


def test_a_call_starts_after_its_dependencies_plus_its_pause():
    turn = Turn("t", [Call("a", [1], 1, pause_s=0.01), Call("b", [1], 1, pause_s=0.0),
                      Call("c", [1], 1, depends_on=["a", "b"], pause_s=0.05, expects_json=True)])
    send, log, state = recording_send(0.03)
    latency, results = replay_turn(turn, send)
    assert log["c"][0] >= max(log["a"][1], log["b"][1]) + 0.05  # deps done, then the pause
    assert log["b"][0] < log["a"][1] and log["a"][0] < log["b"][1]  # independent calls overlap
    assert latency >= 0.01 + 0.03 + 0.05 + 0.03  # the critical path a -> c
    assert [r.broken_json for r in results] == [None, None, False]


def test_users_replay_concurrently_and_count_broken_json():
    turns = [Turn(f"t{i}", [Call("a", [i], 1, expects_json=True), Call("b", [i], 1, depends_on=["a"])])
             for i in range(3)]
    send, _, state = recording_send(0.02)
    result = run_users(turns, lambda c: "not json" if c.prompt_token_ids == [1] and c.id == "a" else send(c), 2, 2)
    assert len(result.turn_latencies_s) == 4 and state["max_in_flight"] == 2
    m = result.metrics
    assert m["broken_json"] == pytest.approx(1 / 4)  # user 1's first turn is t1: its JSON call is broken
    assert m["turn_p90_s"] >= m["turn_p50_s"] > 0 and m["turns_per_s"] > 0


def test_differences_within_the_spread_are_ties():
    def cfg(method, p50s, tps):
        return Config(method, 1, [{"turn_p50_s": a, "turn_p90_s": a, "turns_per_s": b, "broken_json": 0.0}
                                  for a, b in zip(p50s, tps)])

    configs = [cfg("base", [1.0, 1.1, 1.2], [1, 1, 1]), cfg("ngram", [1.15, 1.3, 1.4], [2, 2, 2]),
               cfg("dflash", [0.5, 0.6, 0.7], [0.9, 1.0, 1.05])]
    assert rank(configs, "turn_p50_s") == {"dflash": "*", "base": "", "ngram": ""}
    assert rank(configs, "turns_per_s") == {"ngram": "*", "base": "", "dflash": ""}
    configs[2] = cfg("dflash", [1.05, 1.15, 1.3], [1, 1, 1])
    assert rank(configs, "turn_p50_s") == {"base": "*", "dflash": "=", "ngram": "="}
    lines = table(configs)
    assert lines[-3:] == ["turn_p50_s: 1.100 (base)", "turn_p50_s: 1.300 (ngram)", "turn_p50_s: 1.150 (dflash)"]


# --- against vllm serve ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama_turns(tiny_target, tmp_path_factory):
    """Recorded turns from the synthetic workload's prompts, tokenized for the tiny llama (no generation)."""
    from tests.serving_helpers import workload_prompts

    target = tiny_target("tiny-llama")
    prompts, stages = workload_prompts(target, 52)
    rows = [{"id": f"h{i}", "stage": s, "input_ids": p + [0] * 6, "loss_mask": [0] * len(p) + [1] * 6}
            for i, (p, s) in enumerate(zip(prompts, stages))]
    path = tmp_path_factory.mktemp("turns") / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return target, path


@pytest.mark.slow
@pytest.mark.vllm
def test_benchmark_against_vllm_serve_at_one_and_two_users(llama_turns, tmp_path, capsys):
    from specdistill.launch.evaluate import main

    target, rows = llama_turns
    out = tmp_path / "r.json"
    assert main(["turns", "--target", str(target), "--rows", str(rows), "--method", "base", "--users", "1,2",
                 "--repeats", "2", "--turns-per-user", "1", "--max-tokens", "6", "--json", str(out)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1].startswith("turn_p50_s: ") and lines[-1].endswith("(base)")
    results = json.loads(out.read_text())
    assert [(r["method"], r["users"], len(r["repeats"])) for r in results] == [("base", 1, 2), ("base", 2, 2)]
    for r in results:
        for m in r["repeats"]:
            assert m["turn_p90_s"] >= m["turn_p50_s"] > 0 and m["turns_per_s"] > 0 and 0 <= m["broken_json"] <= 1
    assert float(lines[-1].split()[1]) == pytest.approx(sorted(m["turn_p50_s"] for m in results[1]["repeats"])[0] / 2
                                                        + sorted(m["turn_p50_s"] for m in results[1]["repeats"])[1] / 2,
                                                        abs=1e-3)  # the last line is U=2's median over repeats
