"""Prompts and stages of workload rows, for the serving-side tools (bench/lossless.py, bench/vllm_acceptance.py)."""

from __future__ import annotations

import json
from pathlib import Path


def read_prompts(path: str | Path, tokenizer=None, n: int | None = None) -> tuple[list[list[int]], list[str | None]]:
    """(prompt ids, stage) of the first n rows: pre-tokenized rows (everything before the first loss token; rows
    without a response are skipped) or chat rows (the chat template of all messages but the last, as
    specdistill/data/synthetic.py builds them; needs `tokenizer`)."""
    prompts, stages = [], []
    with Path(path).open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if "input_ids" in row and "loss_mask" in row:
                if 1 not in row["loss_mask"]:
                    continue
                prompts.append(row["input_ids"][: row["loss_mask"].index(1)])
            elif "messages" in row and tokenizer is not None:
                text = tokenizer.apply_chat_template(row["messages"][:-1], tokenize=False, add_generation_prompt=True)
                prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"])
            else:
                raise ValueError(f"{path}:{lineno}: expected fields input_ids + loss_mask (specdistill/data/synthetic.py) or "
                                 f"messages (specdistill/data/workload.py, with a tokenizer); keys present: {sorted(row)}")
            stages.append(row.get("stage"))
            if n is not None and len(prompts) == n:
                break
    return prompts, stages
