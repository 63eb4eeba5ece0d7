"""Optional wandb logging (trainer.wandb_project=NAME); the run dir's train_log.jsonl is always written."""

import json
from pathlib import Path


class Tracker:
    def __init__(self, project: str | None, run_dir: Path, config: dict, enabled: bool):
        self.run_dir, self.enabled = run_dir, enabled
        self.wandb_run = None
        if project and enabled:
            try:
                import wandb
            except ImportError as err:
                raise ImportError("trainer.wandb_project is set but wandb is not installed: "
                                  "pip install 'specdistill[wandb]'") from err
            # The run dir name is the wandb id, so a resumed run continues the same wandb run.
            self.wandb_run = wandb.init(project=project, dir=str(run_dir), config=config,
                                        id=run_dir.resolve().name, resume="allow")

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        with open(self.run_dir / "train_log.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.wandb_run is not None:
            flat = {k: v for k, v in record.items() if not isinstance(v, list)}
            flat.update({f"{k}/{i + 1}": x for k, v in record.items() if isinstance(v, list) for i, x in enumerate(v)})
            self.wandb_run.log(flat, step=record["step"])

    def finish(self, summary: dict) -> None:
        if self.wandb_run is not None:
            self.wandb_run.summary.update({k: v for k, v in summary.items() if isinstance(v, (int, float))})
            self.wandb_run.finish()
