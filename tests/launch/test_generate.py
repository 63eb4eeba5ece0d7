"""Batched generation (specdistill/data/generate.py) and the regenerate CLI (specdistill/launch/regenerate.py, specdistill/data/regenerate.py):
transformers and vLLM against an independent greedy loop, and a kill -9 mid-run resumed without loss."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specdistill.data.generate import GenerationSettings, generate
from specdistill.launch.regenerate import parse, run
from tests.cli import REPO


@pytest.fixture(scope="module")
def random_llama(tiny_llama_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


def test_batched_greedy_equals_one_prompt_at_a_time(random_llama):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 256, (n,), generator=g).tolist() for n in (5, 17, 9, 30, 12)]
    settings = GenerationSettings(max_new_tokens=12, batch_size=4)
    batched = generate(random_llama, prompts, settings, pad_id=0)
    alone = generate(random_llama, prompts, GenerationSettings(max_new_tokens=12, batch_size=1), pad_id=0)
    assert batched == alone
    assert all(len(r) == 12 for r in batched)


def test_generation_stops_at_a_stop_token_and_keeps_it(random_llama):
    prompt = [[3, 4, 5, 6]]
    free = generate(random_llama, prompt, GenerationSettings(max_new_tokens=10), pad_id=0)[0]
    stop = free[3]
    cut = generate(random_llama, prompt, GenerationSettings(max_new_tokens=10), pad_id=0, stop_token_ids=[stop])[0]
    assert cut == free[: free.index(stop) + 1]


def test_sampled_rows_are_seeded_per_prompt(random_llama):
    prompts = [[3, 4, 5], [7, 8, 9, 10], [11, 12]]
    settings = GenerationSettings(max_new_tokens=8, temperature=1.0, seed=3)
    all_three = generate(random_llama, prompts, settings, pad_id=0)
    assert generate(random_llama, prompts, settings, pad_id=0) == all_three  # seeded
    assert generate(random_llama, prompts, GenerationSettings(max_new_tokens=8, temperature=1.0, seed=4),
                    pad_id=0) != all_three  # and the seed matters
    reordered = generate(random_llama, prompts[::-1], settings, pad_id=0)[::-1]
    # seeds go by position in the list: the same prompt at the same index gets the same sample
    assert reordered[1] == all_three[1]


@torch.inference_mode()
def greedy_loop(model, prompt: list[int], max_new_tokens: int, stop_id: int) -> list[int]:
    """The independent reference: the model's full forward over the whole sequence, argmax, append, repeat."""
    ids = list(prompt)
    for _ in range(max_new_tokens):
        token = int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
        ids.append(token)
        if token == stop_id:
            break
    return ids[len(prompt):]


def regen_rows(tiny_target):
    target = tiny_target("tiny-llama")
    tok = AutoTokenizer.from_pretrained(target)
    rows = [{"messages": [{"role": "user", "content": "find red shoes"}, {"role": "assistant", "content": "x"}],
             "stage": "search_queries"},
            {"prompt": "list three tents"},
            {"input_ids": tok("hello", add_special_tokens=False)["input_ids"] + [5, 6]},
            {"input_ids": [7] * 5000}]  # longer than the target's context: skipped, counted
    rows[2]["loss_mask"] = [0] * (len(rows[2]["input_ids"]) - 2) + [1, 1]
    rows += [{"prompt": f"a waterproof {w} under ${20 + 7 * i}"} for i, w in enumerate(["tent", "jacket", "backpack",
                                                                                        "lamp", "chair"] * 4)]
    return target, tok, rows


@pytest.mark.vllm
@pytest.mark.slow
def test_regenerate_vllm_and_hf_equal_an_independent_greedy_loop(tiny_target, tmp_path):
    """fp32 tiny Llama: backend=vllm and backend=hf write the same rows, and those are the model's own greedy
    continuations by a plain forward-argmax loop (no generate(), no KV cache)."""
    target, tok, rows = regen_rows(tiny_target)
    # a conversation: 3 turns, each after the target's own earlier turns (vLLM queues a turn as the one before ends)
    rows.append({"messages": [{"role": "user", "content": "a tent"}, {"role": "assistant", "content": "x"},
                              {"role": "user", "content": "cheaper"}, {"role": "assistant", "content": "y"},
                              {"role": "user", "content": "thanks"}]})
    src = tmp_path / "prompts.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    written = {}
    for backend in ("vllm", "hf"):
        out = tmp_path / f"{backend}.jsonl"
        summary = run(parse([f"target.path={target}", f"input={src}", f"output={out}", "max_new_tokens=12",
                             f"backend={backend}", "dtype=float32"]))
        assert summary["backend"] == backend and summary["rows_written"] == len(rows) - 1 + 2
        assert summary["rows_skipped_too_long"] == 1 and summary["rows_per_s"] > 0
        written[backend] = sorted((json.loads(line) for line in out.read_text().splitlines()),
                                  key=lambda r: (r["id"], r["turn"]))
    assert written["vllm"] == written["hf"]
    assert [r["id"] for r in written["hf"]] == [i for i in range(len(rows)) if i != 3] + [len(rows) - 1] * 2
    assert [r["turn"] for r in written["hf"][-3:]] == [1, 3, 5]
    reply = tok.decode(written["hf"][-3]["input_ids"][written["hf"][-3]["loss_mask"].index(1):],
                       skip_special_tokens=True)
    assert reply in tok.decode(written["hf"][-2]["input_ids"])  # turn 3's history: the target's turn 1
    assert written["hf"][0]["stage"] == "search_queries"  # carried over
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    stop = tok.convert_tokens_to_ids("<|im_end|>")
    for r in written["hf"][:4]:
        prompt = r["input_ids"][: r["loss_mask"].index(1)]
        response = r["input_ids"][len(prompt):]
        assert r["loss_mask"] == [0] * len(prompt) + [1] * len(response)
        assert response == greedy_loop(model, prompt, 12, stop)
    assert written["hf"][0]["input_ids"][:3] == tok(tok.apply_chat_template(
        [{"role": "user", "content": "find red shoes"}], tokenize=False, add_generation_prompt=True),
        add_special_tokens=False)["input_ids"][:3]  # the stale assistant turn is dropped, the prompt kept


@pytest.mark.slow
def test_regenerate_killed_mid_run_resumes_with_every_id_once(tiny_target, tmp_path):
    """kill -9 a run that has written some rows, tear its last line as a crash mid-write would, re-run the same
    command: every id exactly once, none lost, and the rows equal an uninterrupted run's."""
    target, _, rows = regen_rows(tiny_target)
    rows = [r for r in rows if len(r.get("input_ids", [])) < 5000] * 12  # 288 prompts
    src = tmp_path / "prompts.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out.jsonl"
    argv = [f"target.path={target}", f"input={src}", f"output={out}", "max_new_tokens=10", "backend=hf",
            "batch_size=2"]
    proc = subprocess.Popen([sys.executable, "-m", "specdistill.launch.regenerate", *argv], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while (not out.exists() or len(out.read_bytes().splitlines()) < 20) and time.monotonic() < deadline:
        assert proc.poll() is None, "the run ended before it could be killed"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    first = out.read_bytes().splitlines()
    assert 20 <= len(first) < len(rows)
    with out.open("ab") as f:
        f.write(first[-1][: len(first[-1]) // 2])  # a torn line: half a row, no newline
    summary = run(parse(argv))
    assert summary["rows_already_written"] == len(first)
    ids = [json.loads(line)["id"] for line in out.read_text().splitlines()]
    assert sorted(ids) == list(range(len(rows)))  # every id once: none lost, none twice
    clean = tmp_path / "clean.jsonl"
    run(parse([*argv[:2], f"output={clean}", *argv[3:]]))
    by_id = lambda path: sorted(path.read_text().splitlines(), key=lambda line: json.loads(line)["id"])
    assert by_id(out) == by_id(clean)


def test_regenerate_rejects_unknown_keys_and_bad_rows(tmp_path):
    from specdistill.data.regenerate import read_prompts

    with pytest.raises(Exception, match="max_new_token"):
        parse(["input=a", "output=b", "max_new_token=3"])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"input_ids": [1, 2]}\n{"text": "no prompt field"}\n')
    with pytest.raises(ValueError, match=r"line 2 \(row 1\).*messages, prompt, input_ids"):
        read_prompts(bad, chat=None)


def test_auto_backend_keeps_small_jobs_in_transformers(tmp_path, monkeypatch):
    """auto: transformers for a job it finishes before a vLLM engine starts (a dense target under the prompt-token
    cap; a hybrid one, run a row at a time, also at most AUTO_HF_MAX_HYBRID_ROWS rows), vLLM otherwise."""
    import importlib.util

    from specdistill.data import generate as gen

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else
                        real_find_spec(name, *a))
    targets = {}
    for model_type in ("llama", "qwen3_next"):
        targets[model_type] = tmp_path / model_type
        targets[model_type].mkdir()
        (targets[model_type] / "config.json").write_text(json.dumps({"model_type": model_type}))
    cap, rows = gen.AUTO_HF_MAX_PROMPT_TOKENS, gen.AUTO_HF_MAX_HYBRID_ROWS
    assert gen.resolve_backend("auto", targets["llama"], cap - 1, 10 * rows) == "hf"
    assert gen.resolve_backend("auto", targets["llama"], cap, 1) == "vllm"
    assert gen.resolve_backend("auto", targets["qwen3_next"], cap - 1, rows) == "hf"
    assert gen.resolve_backend("auto", targets["qwen3_next"], cap - 1, rows + 1) == "vllm"
    assert gen.resolve_backend("auto", targets["qwen3_next"], cap - 1) == "vllm"  # rows unknown
    assert gen.resolve_backend("auto", targets["qwen3_next"], cap, 1) == "vllm"
    assert gen.resolve_backend("vllm", targets["llama"], 1, 1) == "vllm"
    assert gen.resolve_backend("hf", targets["qwen3_next"], cap, 10 * rows) == "hf"
