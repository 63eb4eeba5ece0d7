"""Batched generation (launch/generate.py) and the regenerate CLI (launch/regenerate.py)."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from launch.generate import GenerationSettings, generate


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


def test_regenerate_replaces_responses_with_the_targets_own(tiny_target, tmp_path):
    from launch.regenerate import parse, regenerate
    from transformers import AutoTokenizer

    target = tiny_target("tiny-llama")
    tok = AutoTokenizer.from_pretrained(target)
    rows = [{"messages": [{"role": "user", "content": "find red shoes"}, {"role": "assistant", "content": "x"}]},
            {"prompt": "list three tents"},
            {"input_ids": tok("hello", add_special_tokens=False)["input_ids"] + [5, 6], "loss_mask": [0, 1, 1]},
            {"input_ids": [7] * 5000}]  # longer than the target's context: skipped, counted
    rows[2]["loss_mask"] = [0] * (len(rows[2]["input_ids"]) - 2) + [1, 1]
    src = tmp_path / "prompts.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "train.jsonl"
    summary = regenerate(parse([f"target.path={target}", f"input={src}", f"output={out}", "max_new_tokens=12"]))
    assert summary["rows_written"] == 3 and summary["rows_skipped_too_long"] == 1
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in written] == [0, 1, 2]
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    for r in written:
        prompt = r["input_ids"][: r["loss_mask"].index(1)]
        response = r["input_ids"][len(prompt):]
        assert r["loss_mask"] == [0] * len(prompt) + [1] * len(response)
        again = generate(model, [prompt], GenerationSettings(max_new_tokens=12), tok.pad_token_id,
                         [tok.convert_tokens_to_ids("<|im_end|>")])[0]
        assert response == again  # the target's own greedy continuation
    assert written[0]["input_ids"][:3] == tok(tok.apply_chat_template(
        [{"role": "user", "content": "find red shoes"}], tokenize=False, add_generation_prompt=True),
        add_special_tokens=False)["input_ids"][:3]  # the stale assistant turn is dropped, the prompt kept


def test_regenerate_rejects_unknown_keys_and_bad_rows(tmp_path):
    from launch.regenerate import parse, read_prompts

    with pytest.raises(Exception, match="max_new_token"):
        parse(["input=a", "output=b", "max_new_token=3"])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"input_ids": [1, 2]}\n{"text": "no prompt field"}\n')
    with pytest.raises(ValueError, match=r"line 2 \(row 1\).*messages, prompt, input_ids"):
        read_prompts(bad, tokenizer=None)
