"""Atomic checkpoints in the run directory, so a crash mid-run resumes from the last one.

Layout: RUN/checkpoints/step_00000050.pt (specdistill/core/run_dir.py; written to a temp name, then renamed: never
half-written).
The state holds the drafter, both optimizers, the step, the data position (row ids already trained on
in the current epoch) and the running counters, so a resumed run continues the same totals.
"""

import logging
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from specdistill.core.run_dir import RunDir, read_checkpoint

log = logging.getLogger(__name__)


@dataclass
class TrainState:
    step: int = 0
    epoch: int = 0
    consumed_row_ids: set[int] = field(default_factory=set)  # trained on in the current epoch
    train_tokens: int = 0
    train_response_tokens: int = 0
    packs: int = 0  # packed sequences trained on (pack_fill = train_tokens / (packs * pack size))
    train_seconds: float = 0.0
    feature_seconds: float = 0.0  # worker-side extraction, summed over workers
    feature_wait_seconds: float = 0.0  # trainer idle waiting for features
    last_loss: float = float("nan")
    # Exactly-once accounting (specdistill/feature_server/ledger.py), summed over epochs; duplicated and lost
    # are the trainer's own count of what reached it, so they must stay 0.
    samples_duplicated: int = 0
    samples_lost: int = 0
    rows_reissued: int = 0
    duplicate_deliveries_dropped: int = 0
    feature_workers_died: int = 0


# Counters each rank keeps over its own shard: the job's value is their sum over the ranks (metrics.json, and a
# resume on another rank count). train_seconds is wall-clock time, the same on every rank: never summed.
SUMMED_OVER_RANKS = ("train_tokens", "train_response_tokens", "packs", "feature_seconds", "feature_wait_seconds",
                     "samples_duplicated", "samples_lost", "rows_reissued", "duplicate_deliveries_dropped",
                     "feature_workers_died")


def rank_entry(state: TrainState, generator: torch.Generator) -> dict:
    """What one rank contributes to a checkpoint: its data position, counters and sampling RNG."""
    return {"state": {**asdict(state), "consumed_row_ids": sorted(state.consumed_row_ids)},
            "generator": generator.get_state()}


def save_checkpoint(run: RunDir, step: int, ranks: list[dict], drafter_state: dict, optimizer_state: dict,
                    meta: dict, keep: int, validation: dict | None = None) -> Path:
    """Rank 0 writes one file: the full drafter and optimizer states (specdistill/trainer/parallel.py), every rank's
    entry (rank_entry), since each rank trains its own shard of the rows, and rank 0's validation state (the
    held-out curve and the best weights, specdistill/trainer/validation.py)."""
    run.checkpoints.mkdir(parents=True, exist_ok=True)
    path, tmp = run.checkpoint(step), run.staging_checkpoint(step)
    payload = {"ranks": ranks, "drafter": drafter_state, "optimizers": optimizer_state, "meta": meta,
               "validation": validation}
    torch.save(payload, tmp)
    os.replace(tmp, path)
    for old in run.checkpoint_files()[:-keep] + run.staging_files():
        old.unlink()  # older checkpoints, and what a crash in the middle of an earlier save left
    return path


@dataclass
class Checkpoint:
    path: Path
    drafter: dict
    optimizers: dict
    ranks: list[dict]
    validation: dict | None = None

    def rank_state(self, rank: int, world_size: int) -> tuple[TrainState, torch.Tensor | None]:
        """This rank's TrainState and RNG state. Saved by as many ranks as now run: each takes its own back (a
        bit-exact resume). Saved by another number of ranks: every rank skips the rows any rank had trained on
        this epoch (each only sees its own shard of them), rank 0 carries the summed counters, and the RNG
        starts fresh."""
        if len(self.ranks) == world_size:
            entry = self.ranks[rank]
            raw = entry["state"]
            return TrainState(**{**raw, "consumed_row_ids": set(raw["consumed_row_ids"])}), entry["generator"]
        states = [entry["state"] for entry in self.ranks]
        consumed = set().union(*(s["consumed_row_ids"] for s in states))
        first = states[0]
        counters = {k: sum(s.get(k, 0) for s in states) if rank == 0 else type(first.get(k, 0))(0) for k in SUMMED_OVER_RANKS}
        log.warning("%s was written by %d trainer rank(s), this run has %d: resuming the epoch with the %d rows "
                    "already trained skipped; sampling RNG restarts", self.path, len(self.ranks), world_size,
                    len(consumed))
        state = TrainState(step=first["step"], epoch=first["epoch"], consumed_row_ids=consumed,
                           last_loss=first["last_loss"], train_seconds=first["train_seconds"], **counters)
        return state, None


def load_checkpoint(path: Path, meta: dict) -> Checkpoint:
    payload = read_checkpoint(path)
    for key in ("drafter", "target_layer_ids", "model_type"):
        if payload["meta"].get(key) != meta.get(key):
            raise ValueError(
                f"{path}: checkpoint was written with {key}={payload['meta'].get(key)!r}, this run has "
                f"{meta.get(key)!r}; use a new hydra.run.dir for a different setup"
            )
    if "ranks" not in payload:
        raise ValueError(f"{path}: a checkpoint from an older specdistill (no per-rank entries); start a new "
                         "hydra.run.dir")
    return Checkpoint(path, payload["drafter"], payload["optimizers"], payload["ranks"], payload.get("validation"))
