"""The demo's committed rows (specdistill/launch/assets/small-real-corpus/) are what `make demo` says they are: windows of the
corpus continued greedily by the committed small-real itself, so the drafter the demo trains learns this target.
Regenerate them with the command in specdistill/launch/assets/small-real-corpus/README.md."""

import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from specdistill.launch.assets import SMALL_REAL_CORPUS_DIR as DATA, SMALL_REAL_DIR as TARGET

ROOT = Path(__file__).resolve().parents[2]


def _rows(name: str, picks: list[int]) -> list[tuple[list[int], list[int]]]:
    table = pq.read_table(DATA / name, columns=["input_ids", "loss_mask"])
    ids, masks = table.column("input_ids").to_pylist(), table.column("loss_mask").to_pylist()
    return [(ids[i], masks[i]) for i in picks]


def test_demo_rows_are_the_committed_targets_greedy_continuations():
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(TARGET), local_files_only=True, torch_dtype=torch.float32).eval()
    train_rows = pq.read_metadata(DATA / "train.parquet").num_rows
    rows = _rows("train.parquet", [0, 1, train_rows // 2, train_rows - 1]) + _rows("heldout.parquet", [0, 1, 2, 3])
    for ids, mask in rows:
        start = mask.index(1)
        assert all(mask[start:]) and not any(mask[:start]), "loss_mask must be 0...0 1...1 (prompt, response)"
        prompt, response = ids[:start], ids[start:]
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=len(response), do_sample=False,
                                 attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        assert out[0, len(prompt):].tolist()[: len(response)] == response


def test_demo_rows_do_not_overlap_and_fit_the_target():
    import json

    context = json.loads((TARGET / "config.json").read_text())["max_position_embeddings"]
    train = {tuple(r) for r in pq.read_table(DATA / "train.parquet", columns=["input_ids"]).column(0).to_pylist()}
    held = pq.read_table(DATA / "heldout.parquet", columns=["input_ids"]).column(0).to_pylist()
    assert len(train) >= 2900 and len(held) == 64
    assert not train & {tuple(r) for r in held}
    assert max(len(r) for r in held) <= context and max(len(r) for r in train) <= context


def test_demo_overrides_compose():
    sys.path.insert(0, str(ROOT))
    from bench.demo import OVERRIDES
    from bench.quality import composed_config

    cfg = composed_config([o for o in OVERRIDES if not o.startswith("hydra.")])
    assert cfg["drafter"]["name"] == "eagle3" and cfg["data"]["train_path"].endswith("train.parquet")
