"""Rebuild a run's exported drafter from its run directory, for evaluation tools.

The weights are the ones the run exported (metrics.json `export_selected`): the best held-out ones kept in the last
checkpoint's validation state, or the last weights. An interrupted run (no metrics.json yet) gives its last
checkpoint's weights. Checkpoints are read weights_only (specdistill/core/run_dir.py), as training and resume read them.
"""

import json
from pathlib import Path

from transformers import AutoTokenizer

from specdistill.core.run_dir import RunDir, read_checkpoint
from specdistill.core.target import TargetHead, TargetInfo
from specdistill.drafters import build_drafter, drafter_config


def load_run(run_dir: str | Path, target_dir: str | Path):
    """(drafter, head, info) with the weights the run exported, in eval mode on CPU."""
    run = RunDir(run_dir)
    config = json.loads(run.run_info.read_text())["config"]
    drafter_fields = dict(config["drafter"])
    cfg = drafter_config(drafter_fields.pop("name"), drafter_fields)
    info = TargetInfo.load(target_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(target_dir), local_files_only=True)
    drafter = build_drafter(cfg, info, tokenizer)
    checkpoint = run.latest_checkpoint()
    if checkpoint is None:
        raise FileNotFoundError(f"{run.checkpoints}: no checkpoint to load")
    payload = read_checkpoint(checkpoint)
    drafter.load_state_dict(exported_weights(run, payload))
    return drafter.eval(), TargetHead(info), info


def exported_weights(run: RunDir, payload: dict) -> dict:
    selected = json.loads(run.metrics.read_text()).get("export_selected") if run.metrics.is_file() else None
    best = (payload.get("validation") or {}).get("best_weights")
    if selected and selected.get("policy") == "best" and best is not None:
        return best
    return payload["drafter"]
