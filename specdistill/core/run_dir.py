"""The run directory's files, named once (Hydra's hydra.run.dir; the contract README.md "The main job" states).

    RUN/run_info.json          git SHA, package versions, argv, resolved config (written first)
    RUN/train_log.jsonl        one record per logged step and per held-out evaluation
    RUN/checkpoints/step_00000050.pt   the last few, each written to step_*.pt.tmp and then renamed
    RUN/export/                the drafter as the serving engine loads it
    RUN/metrics.json           written last: the run finished

Re-running with the same directory resumes from its latest checkpoint.
"""

from pathlib import Path

import torch

CHECKPOINT_SUFFIX = ".pt"
STAGING_SUFFIX = ".pt.tmp"  # a checkpoint being written: never read, removed by the next save


class RunDir:
    def __init__(self, path: str | Path):
        self.path = Path(path)

    @property
    def run_info(self) -> Path:
        return self.path / "run_info.json"

    @property
    def train_log(self) -> Path:
        return self.path / "train_log.jsonl"

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def export(self) -> Path:
        return self.path / "export"

    @property
    def metrics(self) -> Path:
        return self.path / "metrics.json"

    def checkpoint(self, step: int) -> Path:
        return self.checkpoints / f"step_{step:08d}{CHECKPOINT_SUFFIX}"

    def staging_checkpoint(self, step: int) -> Path:
        return self.checkpoints / f"step_{step:08d}{STAGING_SUFFIX}"

    def checkpoint_files(self) -> list[Path]:
        """Complete checkpoints, oldest first (zero-padded steps sort as numbers)."""
        return sorted(self.checkpoints.glob(f"step_*{CHECKPOINT_SUFFIX}"))

    def staging_files(self) -> list[Path]:
        """What a crash in the middle of a save left behind."""
        return sorted(self.checkpoints.glob(f"step_*{STAGING_SUFFIX}"))

    def latest_checkpoint(self) -> Path | None:
        found = self.checkpoint_files()
        return found[-1] if found else None


def read_checkpoint(path: Path) -> dict:
    """The raw payload. weights_only: tensors and plain containers only - a checkpoint can never run code on load."""
    return torch.load(path, map_location="cpu", weights_only=True)
