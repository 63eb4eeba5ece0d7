"""Prompts and stages of workload rows, for the serving-side tools (specdistill/evaluation/lossless.py,
served_acceptance.py)."""

from __future__ import annotations

import json
from pathlib import Path


def read_prompts(path: str | Path, tokenizer=None, n: int | None = None,
                 chat_template_kwargs: dict | None = None) -> tuple[list[list[int]], list[str | None]]:
    """(prompt ids, stage) of the first n rows: pre-tokenized rows (everything before the first loss token; rows
    without a response are skipped) or chat rows (all messages but the last, rendered as training and
    specdistill/data/synthetic.py render a prompt - specdistill/data/chat.py, with the run's
    data.chat_template_kwargs; needs `tokenizer`)."""
    from specdistill.data.chat import ChatFormat

    chat = ChatFormat(tokenizer, chat_template_kwargs) if tokenizer is not None else None
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
            elif "messages" in row and chat is not None:
                prompts.append(chat.prompt_ids(row["messages"][:-1], row.get("tools")))
            else:
                raise ValueError(f"{path}:{lineno}: expected fields input_ids + loss_mask (specdistill/data/synthetic.py) or "
                                 f"messages (specdistill/data/workload.py, with a tokenizer); keys present: {sorted(row)}")
            stages.append(row.get("stage"))
            if n is not None and len(prompts) == n:
                break
    return prompts, stages
