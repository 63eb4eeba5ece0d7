"""Atomic checkpoints in the run directory, so a crash mid-run resumes from the last one.

Layout: RUN/checkpoints/step_00000050.pt (written to a temp name, then renamed: never half-written).
The state holds the drafter, both optimizers, the step, the data position (row ids already trained on
in the current epoch) and the running counters, so a resumed run continues the same totals.
"""

import logging
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

log = logging.getLogger(__name__)


@dataclass
class TrainState:
    step: int = 0
    epoch: int = 0
    consumed_row_ids: set[int] = field(default_factory=set)  # trained on in the current epoch
    train_tokens: int = 0
    train_response_tokens: int = 0
    train_seconds: float = 0.0
    feature_seconds: float = 0.0  # worker-side extraction, summed over workers
    feature_wait_seconds: float = 0.0  # trainer idle waiting for features
    last_loss: float = float("nan")
    # Exactly-once accounting (feature_server/server.py's ledger), summed over epochs; duplicated and lost
    # are the trainer's own count of what reached it, so they must stay 0.
    samples_duplicated: int = 0
    samples_lost: int = 0
    rows_reissued: int = 0
    duplicate_deliveries_dropped: int = 0
    feature_workers_died: int = 0


def checkpoint_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = sorted(checkpoint_dir(run_dir).glob("step_*.pt"))
    return found[-1] if found else None


def save_checkpoint(run_dir: Path, state: TrainState, drafter, optimizers, generator, meta: dict, keep: int) -> Path:
    directory = checkpoint_dir(run_dir)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"step_{state.step:08d}.pt"
    tmp = path.with_suffix(".pt.tmp")
    payload = {
        "state": {**asdict(state), "consumed_row_ids": sorted(state.consumed_row_ids)},
        "drafter": drafter.state_dict(),
        "optimizers": optimizers.state_dict(),
        "generator": generator.get_state(),
        "meta": meta,
    }
    torch.save(payload, tmp)
    os.replace(tmp, path)
    for old in sorted(directory.glob("step_*.pt"))[:-keep] + list(directory.glob("step_*.pt.tmp")):
        old.unlink()  # older checkpoints, and what a crash in the middle of an earlier save left
    return path


def load_checkpoint(path: Path, drafter, optimizers, generator, meta: dict) -> TrainState:
    # weights_only: tensors and plain containers only - a checkpoint can never run code on load.
    payload = torch.load(path, map_location="cpu", weights_only=True)
    for key in ("drafter", "target_layer_ids", "model_type"):
        if payload["meta"].get(key) != meta.get(key):
            raise ValueError(
                f"{path}: checkpoint was written with {key}={payload['meta'].get(key)!r}, this run has "
                f"{meta.get(key)!r}; use a new hydra.run.dir for a different setup"
            )
    drafter.load_state_dict(payload["drafter"])
    optimizers.load_state_dict(payload["optimizers"])
    generator.set_state(payload["generator"])
    raw = payload["state"]
    state = TrainState(**{**raw, "consumed_row_ids": set(raw["consumed_row_ids"])})
    log.info("resumed from %s at step %d (epoch %d, %d rows consumed)", path, state.step, state.epoch,
             len(state.consumed_row_ids))
    return state
