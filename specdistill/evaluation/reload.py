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
    name = pick_drafter(run_dir, list(drafters), name)
    fields = dict(payload["meta"]["drafters"][name]["config"])
    cfg = drafter_config(fields.pop("name"), fields)
    info = TargetInfo.load(target_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(target_dir), local_files_only=True)
    drafter = build_drafter(cfg, info, tokenizer)
    drafter.load_state_dict(exported_weights(run, drafters[name], name))
    return drafter.eval(), TargetHead(info), info


def pick_drafter(run_dir, trained: list[str], name: str | None) -> str:
    """`name` if the run trained it; None: the run's only drafter. The errors name the run and what it trained."""
    if name is None:
        if len(trained) != 1:
            raise ValueError(f"{run_dir} trained drafters {trained}: name the one to use")
        return trained[0]
    if name not in trained:
        raise KeyError(f"{run_dir}: no drafter {name!r}; it trained {trained}")
    return name


def exported_weights(run: RunDir, saved: dict, name: str) -> dict:
    """The weights the run exported for drafter `name`: its best held-out ones or its last (metrics.json says)."""
    metrics = json.loads(run.metrics.read_text()) if run.metrics.is_file() else {}
    selected = (metrics.get("drafters", {}).get(name) or metrics).get("export_selected")
    best = (saved.get("validation") or {}).get("best_weights")
    if selected and selected.get("policy") == "best" and best is not None:
        return best
    return saved["drafter"]


def drafter_names(run_dir: str | Path) -> list[str]:
    """The drafters a run trained, in the run's order (one for a `drafter=NAME` run)."""
    run = RunDir(run_dir)
    if run.metrics.is_file():
        metrics = json.loads(run.metrics.read_text())
        if "drafters" in metrics:
            return list(metrics["drafters"])
    checkpoint = run.latest_checkpoint()
    if checkpoint is None:
        raise FileNotFoundError(f"{run.checkpoints}: no checkpoint to read the run's drafters from")
    return list(read_checkpoint(checkpoint)["drafters"])


def drafter_metrics(run_dir: str | Path, name: str | None = None) -> dict:
    """metrics.json as one drafter's run would have written it: the run's fields with drafter `name`'s (its
    num_speculative_tokens, export_dir, tau_offline, ...). name None: the run's only drafter."""
    run = RunDir(run_dir)
    if not run.metrics.is_file():
        raise FileNotFoundError(f"{run.metrics}: the run has not finished (no metrics.json)")
    metrics = json.loads(run.metrics.read_text())
    several = metrics.pop("drafters", None)
    if several is None:  # a drafter=NAME run: flat; its export is export/
        if name is not None:
            pick_drafter(run_dir, drafter_names(run_dir), name)
        return metrics
    return {**metrics, **several[pick_drafter(run_dir, list(several), name)]}


def export_dir(run_dir: str | Path, name: str | None = None) -> Path:
    """Where the run exported drafter `name` (None: its only one): export/ for a `drafter=NAME` run, export/<name>/
    for a `drafters=[...]` run, read under run_dir wherever the run dir now lies."""
    metrics = drafter_metrics(run_dir, name)
    run = RunDir(run_dir)
    return run.export / metrics["name"] if "drafters" in json.loads(run.metrics.read_text()) else run.export
