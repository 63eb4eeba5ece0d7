"""Rebuild a finished (or interrupted) run's drafter from its run directory, for evaluation tools."""

import json
from pathlib import Path

import torch
from transformers import AutoTokenizer

from drafters import build_drafter, drafter_config
from trainer.checkpoint import latest_checkpoint
from trainer.target import TargetHead, TargetInfo


def load_run(run_dir: str | Path, target_dir: str | Path):
    """(drafter, head, info) with the weights of the run's last checkpoint, in eval mode on CPU."""
    run_dir = Path(run_dir)
    config = json.loads((run_dir / "run_info.json").read_text())["config"]
    drafter_fields = dict(config["drafter"])
    cfg = drafter_config(drafter_fields.pop("name"), drafter_fields)
    info = TargetInfo.load(target_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(target_dir), local_files_only=True)
    drafter = build_drafter(cfg, info, tokenizer)
    checkpoint = latest_checkpoint(run_dir)
    if checkpoint is None:
        raise FileNotFoundError(f"{run_dir}/checkpoints: no checkpoint to load")
    drafter.load_state_dict(torch.load(checkpoint, map_location="cpu", weights_only=False)["drafter"])
    return drafter.eval(), TargetHead(info), info
