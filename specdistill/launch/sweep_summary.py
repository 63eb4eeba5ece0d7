"""Sweep summary: after `specdistill-train -m ...`, one table of every run in the sweep dir.

A Hydra Callback (registered in specdistill/conf/config.yaml's hydra.callbacks): on_multirun_end reads each job's
metrics.json and .hydra/overrides.yaml and writes SWEEP_DIR/sweep_summary.md and sweep_summary.csv.
It reads the files rather than the jobs' return values so it works for any launcher, including ones that run
jobs in other processes, and a job that left no metrics.json shows up as a row saying so.
"""

import csv
import json
import logging
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from specdistill.core.run_dir import RunDir

log = logging.getLogger(__name__)

COLUMNS = ("run", "overrides", "drafter", "steps", "tau_offline", "final_loss", "tokens_per_s", "status")


def summary_rows(job_dir: Path, sweep_dir: Path) -> list[dict]:
    """The job's row; a `drafters=[...]` job gives a row per drafter (run `DIR/NAME`)."""
    overrides_file = job_dir / ".hydra" / "overrides.yaml"
    overrides = OmegaConf.load(overrides_file) if overrides_file.is_file() else []
    row = {"run": str(job_dir.relative_to(sweep_dir)), "overrides": list(overrides)}
    metrics_file = RunDir(job_dir).metrics
    if not metrics_file.is_file():
        return [{**row, "status": "no metrics.json (failed or unfinished)"}]
    m = json.loads(metrics_file.read_text())
    drafters = m.get("drafters") or {None: m}
    rows = []
    for name, d in drafters.items():
        seconds = d.get("training_seconds") or 0.0
        # tokens/s of the training steps alone (feature extraction overlaps them in other processes)
        tokens_per_s = m["train_tokens"] / seconds if seconds > 0 else None
        rows.append({**row, "run": row["run"] + (f"/{name}" if name else ""), "drafter": d.get("drafter"),
                     "steps": d.get("steps"), "tau_offline": d.get("tau_offline"), "final_loss": d.get("final_loss"),
                     "tokens_per_s": tokens_per_s, "status": "ok" if not d.get("stopped_early") else "stopped early"})
    return rows


def collect_rows(sweep_dir: Path) -> tuple[list[dict], list[str]]:
    """Every job dir of the sweep (a subdir holding .hydra/, what Hydra writes first), in job order, each with the
    overrides that tell it apart; and the overrides all jobs share."""
    job_dirs = {p.parent.parent for p in sweep_dir.glob("**/.hydra/overrides.yaml")}
    job_dirs |= {p.parent for p in sweep_dir.glob("**/metrics.json")}
    rows = [r for d in sorted(job_dirs, key=_job_order) for r in summary_rows(d, sweep_dir)]
    shared = [o for o in rows[0]["overrides"] if all(o in r["overrides"] for r in rows)] if rows else []
    for r in rows:
        r["overrides"] = " ".join(o for o in r["overrides"] if o not in shared)
    return rows, shared


def write_summary(sweep_dir: Path) -> tuple[Path, Path]:
    rows, shared = collect_rows(sweep_dir)
    csv_path, md_path = sweep_dir / "sweep_summary.csv", sweep_dir / "sweep_summary.md"
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows({k: _cell(r.get(k), csv=True) for k in COLUMNS} for r in rows)
    lines = [f"# Sweep summary: {sweep_dir}", "", f"Overrides of every run: `{' '.join(shared) or '(none)'}`", "",
             "tokens_per_s = train_tokens / training_seconds (metrics.json).", "",
             "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_cell(r.get(k)) for k in COLUMNS) + " |" for r in rows]
    md_path.write_text("\n".join(lines) + "\n")
    return md_path, csv_path


class SweepSummary(Callback):
    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        if not sweep_dir.is_dir():
            log.warning("sweep dir %s does not exist: no sweep summary written", sweep_dir)
            return
        md_path, csv_path = write_summary(sweep_dir)
        log.info("sweep summary: %s and %s", md_path, csv_path)


def _job_order(job_dir: Path):
    head = job_dir.name.split("-", 1)[0]  # hydra.sweep.subdir starts with the job number
    return (0, int(head), str(job_dir)) if head.isdigit() else (1, 0, str(job_dir))


def _cell(value, csv: bool = False) -> str:
    if value is None:
        return "" if csv else "-"
    if isinstance(value, float):
        return repr(value) if csv else f"{value:.4g}"
    return str(value) if csv else str(value).replace("|", "\\|")
