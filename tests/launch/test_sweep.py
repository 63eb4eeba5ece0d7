"""specdistill/launch/sweep_summary.py: a real `specdistill-train -m` sweep writes its summary table; the table itself."""

import csv
import json
import os
import sys
from pathlib import Path

import pytest

from specdistill.core.run_dir import RunDir
from specdistill.launch.sweep_summary import collect_rows, write_summary
from tests.processes import run_bounded
from tests.cli import REPO, SMALL


def _fake_job(sweep_dir: Path, name: str, overrides: list[str], metrics: dict | None) -> None:
    job = sweep_dir / name
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    if metrics is not None:
        RunDir(job).metrics.write_text(json.dumps(metrics))


def test_table_rows_follow_job_numbers_and_flag_missing_metrics(tmp_path):
    _fake_job(tmp_path, "10-dflash", ["trainer.lr=0.1"], {"drafter": "dflash", "steps": 3, "tau_offline": 2.0,
                                                            "final_loss": 1.25, "train_tokens": 300,
                                                            "training_seconds": 1.5})
    _fake_job(tmp_path, "2-mtp", ["drafter=mtp", "trainer.lr=0.1"], None)
    rows, shared = collect_rows(tmp_path)
    assert [r["run"] for r in rows] == ["2-mtp", "10-dflash"]  # numeric, not lexical, job order
    assert rows[0]["status"].startswith("no metrics.json") and rows[1]["tokens_per_s"] == 200.0
    assert shared == ["trainer.lr=0.1"] and rows[0]["overrides"] == "drafter=mtp"
    md_path, csv_path = write_summary(tmp_path)
    assert "| 10-dflash |  | dflash | 3 | 2 | 1.25 | 200 | ok |" in md_path.read_text()


@pytest.mark.slow
def test_two_by_one_sweep_writes_summary(tmp_path, cache_dir, tiny_target):
    """drafter=dflash,dflash2 x one lr: two job dirs, each a full run, and one table of both (plus wandb offline
    runs, one per job, grouped: the logger group wired through the CLI)."""
    tiny_target("tiny-llama")
    sweep_dir = tmp_path / "sweep"
    small = [a for a in SMALL if not a.startswith("drafter=")]
    cmd = [sys.executable, "-m", "specdistill.launch.train", "-m", "drafter=dflash,dflash2", "trainer.lr=0.002",
           "target=tiny-llama", *small, "trainer.max_steps=2", "trainer.checkpoint_every=100",
           "logger=wandb", "logger.group=test-sweep", f"hydra.sweep.dir={sweep_dir}"]
    env = {**os.environ, "SPECDISTILL_CACHE": str(cache_dir), "WANDB_MODE": "online", "WANDB_API_KEY": ""}
    proc = run_bounded(cmd, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]

    with open(sweep_dir / "sweep_summary.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["run"], r["drafter"], r["status"]) for r in rows] == [("0-dflash", "dflash", "ok"),
                                                                      ("1-dflash2", "dflash2", "ok")]
    for row in rows:
        metrics = json.loads(RunDir(sweep_dir / row["run"]).metrics.read_text())
        assert float(row["tau_offline"]) == metrics["tau_offline"] and 1.0 <= metrics["tau_offline"] <= 8.0
        assert float(row["tokens_per_s"]) == pytest.approx(metrics["train_tokens"] / metrics["training_seconds"])
        assert row["overrides"] == f"drafter={row['drafter']}" and RunDir(sweep_dir / row["run"]).export.is_dir()
        assert len(list((sweep_dir / row["run"] / "wandb").glob("offline-run-*/run-*.wandb"))) == 1
    table = (sweep_dir / "sweep_summary.md").read_text()
    assert "| 0-dflash |" in table and "| 1-dflash2 |" in table and "trainer.lr=0.002" in table
