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


def load_run(run_dir: str | Path, target_dir: str | Path, name: str | None = None):
    """(drafter, head, info) with the weights the run exported, in eval mode on CPU. name: which drafter of a
    `drafters=[...]` run (None: the run's only one)."""
    run = RunDir(run_dir)
    checkpoint = run.latest_checkpoint()
    if checkpoint is None:
        raise FileNotFoundError(f"{run.checkpoints}: no checkpoint to load")
    payload = read_checkpoint(checkpoint)
    drafters = payload["drafters"]
    if name is None:
        if len(drafters) != 1:
            raise ValueError(f"{run_dir} trained drafters {sorted(drafters)}: name the one to load")
        (name,) = drafters
    if name not in drafters:
        raise KeyError(f"{run_dir}: no drafter {name!r}; it trained {sorted(drafters)}")
    fields = dict(payload["meta"]["drafters"][name]["config"])
    cfg = drafter_config(fields.pop("name"), fields)
    info = TargetInfo.load(target_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(target_dir), local_files_only=True)
    drafter = build_drafter(cfg, info, tokenizer)
    drafter.load_state_dict(exported_weights(run, drafters[name], name))
    return drafter.eval(), TargetHead(info), info


def exported_weights(run: RunDir, saved: dict, name: str) -> dict:
    """The weights the run exported for drafter `name`: its best held-out ones or its last (metrics.json says)."""
    metrics = json.loads(run.metrics.read_text()) if run.metrics.is_file() else {}
    selected = (metrics.get("drafters", {}).get(name) or metrics).get("export_selected")
    best = (saved.get("validation") or {}).get("best_weights")
    if selected and selected.get("policy") == "best" and best is not None:
        return best
    return saved["drafter"]
