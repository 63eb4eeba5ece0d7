"""Run tracking: train_log.jsonl in the run dir always; wandb too when `logger=wandb` (specdistill/conf/logger/).

wandb runs offline unless `logger.mode=online`: the run lands in RUN_DIR/wandb/offline-run-*/ and can be
uploaded later with `wandb sync`. Nothing reaches the network by default, whatever WANDB_MODE says.
"""

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from specdistill.core.run_dir import RunDir

LOGGER_BACKENDS = ("none", "wandb")
WANDB_MODES = ("offline", "online")


@dataclass
class LoggerConfig:
    backend: str = "none"  # none | wandb
    mode: str = "offline"  # offline | online (wandb only; online needs `wandb login` and network)
    project: str = "specdistill"
    entity: str | None = None
    group: str | None = None  # e.g. one per sweep
    tags: list[str] = field(default_factory=list)


def check_logger_config(cfg: LoggerConfig) -> None:
    if cfg.backend not in LOGGER_BACKENDS:
        raise ValueError(f"logger.backend={cfg.backend!r}; valid: {', '.join(LOGGER_BACKENDS)} (pick with logger=NAME)")
    if cfg.mode not in WANDB_MODES:
        raise ValueError(f"logger.mode={cfg.mode!r}; valid: {', '.join(WANDB_MODES)}")


def flatten_lists(record: dict) -> dict:
    """{'acc': [a, b]} -> {'acc/1': a, 'acc/2': b} (1-based = draft position); None values dropped."""
    flat = {}
    for key, value in record.items():
        if isinstance(value, (list, tuple)):
            flat.update({f"{key}/{i + 1}": x for i, x in enumerate(value) if x is not None})
        elif value is not None:
            flat[key] = value
    return flat


class Tracker:
    def __init__(self, cfg: LoggerConfig, run_dir: Path, config: dict, enabled: bool):
        check_logger_config(cfg)
        self.log_file, self.enabled = RunDir(run_dir).train_log, enabled
        self.wandb_run = _init_wandb(cfg, run_dir, config) if cfg.backend == "wandb" and enabled else None

    @classmethod
    def from_run_config(cls, config: dict, run_dir: Path, enabled: bool) -> "Tracker":
        """The `logger` node of the resolved run config (already schema-checked at compose time)."""
        return cls(LoggerConfig(**(config.get("logger") or {})), run_dir, config, enabled)

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        with open(self.log_file, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.wandb_run is not None:
            self.wandb_run.log(flatten_lists(record), step=record["step"])

    def finish(self, summary: dict) -> None:
        """Final metrics (tau_offline, per_position_acceptance/K, export_dir, ...) into the wandb summary."""
        if self.wandb_run is None:
            return
        keep = {k: v for k, v in summary.items() if isinstance(v, (int, float, str, list, tuple))}
        self.wandb_run.summary.update(flatten_lists(keep))
        self.wandb_run.finish()
        self.wandb_run = None
        import wandb

        # finish() returns before wandb's core process has flushed the offline datastore (measured: the .wandb
        # file can still be empty); teardown waits for it, so the run is on disk when training returns.
        wandb.teardown()


def _init_wandb(cfg: LoggerConfig, run_dir: Path, config: dict):
    try:
        import wandb
    except ImportError as err:
        raise ImportError("logger=wandb but wandb is not installed: pip install 'specdistill[wandb]'") from err
    run_dir.mkdir(parents=True, exist_ok=True)
    # The id hashes the absolute run dir: stable, so a resumed run continues its wandb run, and unique, so
    # sweep subdirs named alike (0-dflash) in different sweeps never collide.
    run_id = hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:16]
    # mode= passed explicitly wins over a WANDB_MODE in the environment: offline unless asked otherwise.
    return wandb.init(project=cfg.project, entity=cfg.entity, group=cfg.group, tags=list(cfg.tags) or None,
                      dir=str(run_dir), config=config, id=run_id, name=run_dir.name, resume="allow",
                      mode=cfg.mode)
