"""Atomic checkpoints in the run directory, so a crash mid-run resumes from the last one.

Layout: RUN/checkpoints/step_00000050.pt (specdistill/core/run_dir.py; written to a temp name, then renamed: never
half-written).
The state holds every drafter of the run (weights, both optimizers, validation: the curve and the best weights),
the step, each rank's data position (row ids already trained on in the current epoch), running counters and, per
drafter, its sampling generator and its own progress (steps, seconds, whether it stopped), so a resumed run
continues them all with the same totals. One file per step holds all drafters: they are written and resumed
together.
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
    target_tokens: int = 0  # tokens the feature workers prefilled (training, held-out and probe rows)


# Counters each rank keeps over its own shard: the job's value is their sum over the ranks (metrics.json, and a
# resume on another rank count). train_seconds is wall-clock time, the same on every rank: never summed.
SUMMED_OVER_RANKS = ("train_tokens", "train_response_tokens", "packs", "feature_seconds", "feature_wait_seconds",
                     "samples_duplicated", "samples_lost", "rows_reissued", "duplicate_deliveries_dropped",
                     "feature_workers_died", "target_tokens")


def rank_entry(state: TrainState, drafters: dict[str, dict]) -> dict:
    """What one rank contributes to a checkpoint: its data position and counters, and per drafter its sampling
    generator state and progress (`Entry.state()` plus "generator")."""
    return {"state": {**asdict(state), "consumed_row_ids": sorted(state.consumed_row_ids)}, "drafters": drafters}


def save_checkpoint(run: RunDir, step: int, ranks: list[dict], drafters: dict[str, dict], meta: dict,
                    keep: int) -> Path:
    """Rank 0 writes one file: per drafter its full weights and optimizer states (specdistill/trainer/parallel.py)
    and rank 0's validation state (the held-out curve and the best weights, specdistill/trainer/validation.py), and
    every rank's entry (rank_entry), since each rank trains its own shard of the rows."""
    run.checkpoints.mkdir(parents=True, exist_ok=True)
    path, tmp = run.checkpoint(step), run.staging_checkpoint(step)
    payload = {"ranks": ranks, "drafters": drafters, "meta": meta}
    torch.save(payload, tmp)
    os.replace(tmp, path)
    for old in run.checkpoint_files()[:-keep] + run.staging_files():
        old.unlink()  # older checkpoints, and what a crash in the middle of an earlier save left
    return path


@dataclass
class Checkpoint:
    path: Path
    drafters: dict[str, dict]  # name -> {"drafter", "optimizers", "validation"}
    ranks: list[dict]

    def rank_state(self, rank: int, world_size: int) -> tuple[TrainState, dict[str, dict]]:
        """This rank's TrainState and, per drafter, its generator state and progress. Saved by as many ranks as now
        run: each takes its own back (a bit-exact resume). Saved by another number of ranks: every rank skips the
        rows any rank had trained on this epoch (each only sees its own shard of them), rank 0 carries the summed
        counters, and the drafters' RNGs start fresh (their progress is rank 0's, without a generator state)."""
        if len(self.ranks) == world_size:
            entry = self.ranks[rank]
            raw = entry["state"]
            return TrainState(**{**raw, "consumed_row_ids": set(raw["consumed_row_ids"])}), entry["drafters"]
        states = [entry["state"] for entry in self.ranks]
        consumed = set().union(*(s["consumed_row_ids"] for s in states))
        first = states[0]
        counters = {k: sum(s.get(k, 0) for s in states) if rank == 0 else type(first.get(k, 0))(0) for k in SUMMED_OVER_RANKS}
        log.warning("%s was written by %d trainer rank(s), this run has %d: resuming the epoch with the %d rows "
                    "already trained skipped; sampling RNG restarts", self.path, len(self.ranks), world_size,
                    len(consumed))
        state = TrainState(step=first["step"], epoch=first["epoch"], consumed_row_ids=consumed,
                           last_loss=first["last_loss"], train_seconds=first["train_seconds"], **counters)
        # A drafter's progress (steps, stopped, seconds) is the same on every rank: rank 0's, without its RNG.
        progress = {name: {k: v for k, v in saved.items() if k != "generator"}
                    for name, saved in self.ranks[0]["drafters"].items()}
        return state, progress


def load_checkpoint(path: Path, meta: dict) -> Checkpoint:
    """The checkpoint at `path`, refused when it was written for another setup: other drafters (names, kinds,
    layer ids) or another target."""
    payload = read_checkpoint(path)
    if "ranks" not in payload or "drafters" not in payload:
        raise ValueError(f"{path}: a checkpoint from an older specdistill (no per-drafter entries); start a new "
                         "hydra.run.dir")
    saved = payload["meta"]
    if saved.get("model_type") != meta.get("model_type"):
        raise ValueError(f"{path}: checkpoint was written for a {saved.get('model_type')!r} target, this run has "
                         f"{meta.get('model_type')!r}; use a new hydra.run.dir for a different setup")
    if sorted(saved["drafters"]) != sorted(meta["drafters"]):
        raise ValueError(f"{path}: checkpoint holds drafters {sorted(saved['drafters'])}, this run trains "
                         f"{sorted(meta['drafters'])}; resume with the same drafters, or use a new hydra.run.dir")
    for name, want in meta["drafters"].items():
        for key in ("drafter", "target_layer_ids"):
            if saved["drafters"][name].get(key) != want.get(key):
                raise ValueError(
                    f"{path}: drafter {name!r} was written with {key}={saved['drafters'][name].get(key)!r}, this run "
                    f"has {want.get(key)!r}; use a new hydra.run.dir for a different setup")
    return Checkpoint(path, payload["drafters"], payload["ranks"])
