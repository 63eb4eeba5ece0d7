"""Atomic, durable checkpoints in the run directory, so a crash mid-run resumes from the last one.

Layout: RUN/checkpoints/step_00000050.pt (specdistill/core/run_dir.py; written to a temp name, flushed to disk
(fsync), then renamed and the directory fsynced: a crashed process never leaves a half-written checkpoint, and a
crashed machine keeps the rename only once the bytes are on disk). Should the newest checkpoint still not load (a
disk or filesystem that lost it), a resume falls back to the one before it, saying so, every rank agreeing on which
(load_latest_checkpoint; trainer.keep_checkpoints=1 keeps none to fall back to).
The state holds every drafter of the run (weights, both optimizers, validation: the curve and the best weights),
the step, each rank's data position (row ids already trained on in the current epoch), running counters and, per
drafter, its sampling generator and its own progress (steps, seconds, whether it stopped), so a resumed run
continues them all with the same totals. One file per step holds all drafters: they are written and resumed
together.
"""

import logging
import os
from collections.abc import Callable
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
    train_rows: int = 0  # rows in those packs (rows_per_pack)
    feature_bytes: int = 0  # target-state bytes those packs' rows shipped (feature_bytes_per_response_token)
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
SUMMED_OVER_RANKS = ("train_tokens", "train_response_tokens", "packs", "train_rows", "feature_bytes", "feature_seconds", "feature_wait_seconds",
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
    with open(tmp, "wb") as f:
        torch.save(payload, f)
        f.flush()
        os.fsync(f.fileno())  # the bytes on disk before the rename can be
    os.replace(tmp, path)
    _fsync_dir(run.checkpoints)  # the rename itself
    for old in run.checkpoint_files()[:-keep] + run.staging_files():
        old.unlink()  # older checkpoints, and what a crash in the middle of an earlier save left
    return path


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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


# Drafter config fields that cannot change what is trained (implementations tested equal to the reference): a
# resume may change them. Any other difference from the checkpoint's record of an entry refuses the resume.
RESUME_FREE_FIELDS = ("attention_impl", "moe_impl")
_ABSENT = "<not set>"


def load_checkpoint(path: Path, meta: dict) -> Checkpoint:
    """The checkpoint at `path`, refused when it was written for another setup (check_checkpoint)."""
    return check_checkpoint(path, read_checkpoint(path), meta)


def load_latest_checkpoint(run: RunDir, meta: dict, keep: int,
                           gather: Callable[[object], list] = lambda x: [x]) -> Checkpoint | None:
    """The newest checkpoint every rank reads (None: the run has none). One that does not load on some rank (a
    machine crash can lose a file's bytes) is passed over for the one before it, saying so. `gather` gives every
    rank's value on every rank (distributed.gather_objects): every rank tries rank 0's list of files, newest first,
    and takes the first that loads on all of them."""
    names = gather([p.name for p in run.checkpoint_files()])[0]
    passed = []
    for path in reversed([run.checkpoints / name for name in names]):
        payload, error = _read(path)
        everyone = gather(error)
        failed = [(rank, e) for rank, e in enumerate(everyone) if e is not None]
        if not failed:
            if passed:
                log.warning("resuming from %s: the newer %s", path, "; ".join(passed))
            return check_checkpoint(path, payload, meta)
        rank, first = failed[0]
        passed.append(f"{path.name} does not load ({first}{f', on rank {rank}' if len(everyone) > 1 else ''})")
    if passed:
        raise RuntimeError(f"{run.checkpoints}: no checkpoint loads: {'; '.join(passed)}. "
                           f"{_nothing_to_fall_back_to(len(names), keep)}")
    return None


def _read(path: Path) -> tuple[dict | None, str | None]:
    try:
        return read_checkpoint(path), None
    except Exception as e:  # truncated or corrupt: torch.load's errors vary with where the bytes stop
        return None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def _nothing_to_fall_back_to(found: int, keep: int) -> str:
    kept = (f"trainer.keep_checkpoints={keep} keeps no earlier checkpoint to fall back to (keep 2 or more to "
            "survive a lost one). " if keep == 1 and found == 1 else "")
    return (f"{kept}Move the checkpoints directory away to train this run from step 0, or use a new "
            "hydra.run.dir")


def check_checkpoint(path: Path, payload: dict, meta: dict) -> Checkpoint:
    """`payload` (read from `path`), refused when it was written for another setup: other drafters (names, kinds,
    layer ids, configs: check_entry) or another target."""
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
        check_entry(path, name, saved["drafters"][name], want)
    return Checkpoint(path, payload["drafters"], payload["ranks"])


def check_entry(path: Path, name: str, saved: dict, want: dict) -> None:
    """An entry resumes only as what it was written as (entries.py Entry.record): the same kind, layer ids, drafter
    config (less RESUME_FREE_FIELDS) and own trainer settings. Entries are resumed by name, and drafters=[...] in
    another order renames them: each would load another's weights, optimizer and curve."""
    for key in ("drafter", "target_layer_ids"):
        if saved.get(key) != want.get(key):
            raise ValueError(f"{path}: drafter {name!r} was written with {key}={saved.get(key)!r}, this run has "
                             f"{want.get(key)!r}; use a new hydra.run.dir for a different setup")
    differ = []
    for section, prefix in (("config", ""), ("trainer", "trainer.")):
        if section not in saved:  # an older specdistill did not record its entries' own trainer settings
            continue
        old, new = saved[section], want.get(section, {})
        differ += [(prefix + k, old.get(k, _ABSENT), new.get(k, _ABSENT)) for k in sorted(old.keys() | new.keys())
                   if k not in RESUME_FREE_FIELDS and old.get(k, _ABSENT) != new.get(k, _ABSENT)]
    if differ:
        field_, old, new = differ[0]
        also = f" (also {', '.join(d[0] for d in differ[1:])})" if len(differ) > 1 else ""
        raise ValueError(f"{path}: drafter {name!r} was written with {field_}={old!r}, this run has {field_}="
                         f"{new!r}{also}. A resume loads each drafter's weights, optimizer and curve by its name, "
                         "and drafters=[...] in another order renames the entries; resume with the run's own "
                         f"settings (run_info.json), or use a new hydra.run.dir. Only {', '.join(RESUME_FREE_FIELDS)} "
                         "may change on a resume")
