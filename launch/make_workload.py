"""Replay synthetic workload prompts through a target and write the pre-tokenized train / heldout sets.

    python -m launch.make_workload --target DIR --out DIR --rows N --heldout M \
        [--max-new-tokens 48] [--prompt-tokens 400] [--seed 0]

The responses are the target's own greedy continuations (the drafter learns the target, not the template).
Generation runs one row at a time: no padding, because left-padding corrupts the DeltaNet recurrent state of
hybrid targets. Output rows: {"id", "stage", "input_ids", "loss_mask", "prompt_text", "response_text"};
loss_mask is 1 exactly on the generated tokens, including the generated <|im_end|> if the target emitted one.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from launch.workload import DEFAULT_PROMPT_TOKENS, generate_rows

END_OF_TURN = "<|im_end|>"


def _replay(model, tokenizer, rows: list[dict], max_new_tokens: int, desc: str) -> list[dict]:
    eos_id = tokenizer.convert_tokens_to_ids(END_OF_TURN)
    out = []
    for row in tqdm(rows, desc=desc, unit="row"):
        prompt_text = tokenizer.apply_chat_template(row["messages"][:-1], tokenize=False, add_generation_prompt=True)
        prompt_ids = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            seq_1T = model.generate(
                torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos_id,
                pad_token_id=tokenizer.pad_token_id,
            )
        response_ids = seq_1T[0, len(prompt_ids):].tolist()
        if eos_id in response_ids:  # generate stops at eos; keep it, drop anything after (never expected)
            response_ids = response_ids[: response_ids.index(eos_id) + 1]
        out.append({
            "id": row["id"], "stage": row["stage"],
            "input_ids": prompt_ids + response_ids,
            "loss_mask": [0] * len(prompt_ids) + [1] * len(response_ids),
            "prompt_text": prompt_text,
            "response_text": tokenizer.decode(response_ids, skip_special_tokens=True),
        })
    return out


def _write_jsonl(rows: list[dict], path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    os.replace(tmp, path)  # atomic: readers see the old file or the whole new one


def make_workload(
    target_dir: str | Path,
    out_dir: str | Path,
    rows: int,
    heldout: int,
    max_new_tokens: int = 48,
    prompt_tokens: int = DEFAULT_PROMPT_TOKENS,
    seed: int = 0,
) -> tuple[Path, Path]:
    """Write out_dir/train.jsonl (`rows` rows) and out_dir/heldout.jsonl (`heldout` rows, other sessions)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    # Checkpoint dtype (bf16 for the hybrid targets): the same numerics family vLLM serves.
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype="auto").eval()

    def count_tokens(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    # Decode steps of a tiny model are too small to share across threads: on a busy 2-core machine one thread
    # generated a row in ~1.5 s, two threads in ~25 s.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    paths, t0 = [], time.perf_counter()
    try:
        for split, n in (("train", rows), ("heldout", heldout)):
            prompts = generate_rows(n, seed=seed, split=split, prompt_tokens=prompt_tokens, count_tokens=count_tokens)
            path = out_dir / f"{split}.jsonl"
            _write_jsonl(_replay(model, tokenizer, prompts, max_new_tokens, desc=split), path)
            paths.append(path)
    finally:
        torch.set_num_threads(threads)
    elapsed = time.perf_counter() - t0
    meta = {"target": str(target_dir), "rows": rows, "heldout": heldout, "max_new_tokens": max_new_tokens,
            "prompt_tokens": prompt_tokens, "seed": seed, "seconds": round(elapsed, 2),
            "rows_per_s": round((rows + heldout) / max(elapsed, 1e-9), 3), "argv": sys.argv,
            "torch": torch.__version__}
    (out_dir / "workload_meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return paths[0], paths[1]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", required=True, help="target checkpoint directory")
    p.add_argument("--out", required=True, help="output directory for train.jsonl / heldout.jsonl")
    p.add_argument("--rows", type=int, required=True)
    p.add_argument("--heldout", type=int, required=True)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--prompt-tokens", type=int, default=DEFAULT_PROMPT_TOKENS)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    train, held = make_workload(a.target, a.out, a.rows, a.heldout, a.max_new_tokens, a.prompt_tokens, a.seed)
    print(f"wrote {train} and {held}")


if __name__ == "__main__":
    main()
