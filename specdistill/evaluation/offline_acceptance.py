"""Offline acceptance of trained drafters on held-out rows: JSON per drafter and per stage, plus one plot.

    specdistill-eval acceptance --run RUN_DIR [--run RUN_DIR2 ...] --rows heldout.jsonl --out DIR \
        [--drafter NAME ...] [--temperature 0] [--draft-mode greedy|sample] [--seed 0] [--max-rows N]
        [--max-tokens N] [--target DIR]

Each run dir is a finished (or interrupted) training run (specdistill.evaluation.reload.load_run: its last checkpoint);
every drafter it trained is evaluated (a `drafters=[...]` run has several), or those named by --drafter. The
target defaults to the one the run trained against (metrics.json "target"). Writes DIR/acceptance.json
({"runs": {label: report}}, report = tau, per_position a_k, conditional a_k/a_{k-1}, counters, by_stage) and
DIR/acceptance.png (a_k and conditional acceptance by position, one line per drafter), and prints `tau[label]: X`
lines. The walk and the T > 0 rule are specdistill.evaluation.acceptance's (the same code as metrics.json's
tau_offline). The command line: specdistill/launch/evaluate.py.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from specdistill.core.run_dir import RunDir


def run_target(run_dir: Path) -> Path:
    """The target a run trained against: metrics.json's "target", else run_info.json's resolved target path."""
    metrics = RunDir(run_dir).metrics
    if metrics.is_file():
        return Path(json.loads(metrics.read_text())["target"])
    raise FileNotFoundError(f"{run_dir}: no metrics.json to read the target from; pass --target DIR")


def run_label(run_dir: Path, drafter_name: str, taken: set[str]) -> str:
    label = f"{drafter_name}:{run_dir.name}"
    n = 2
    while label in taken:  # two runs of the same name: keep both
        label, n = f"{drafter_name}:{run_dir.name}#{n}", n + 1
    return label


def run_drafters(run_dir: Path, wanted: list[str]) -> list[str]:
    """The run's drafters to evaluate: all it trained, or those of `wanted` it trained (an error when none)."""
    from specdistill.evaluation.reload import drafter_names

    trained = drafter_names(run_dir)
    chosen = [n for n in trained if n in wanted] if wanted else trained
    if not chosen:
        raise ValueError(f"{run_dir} trained {trained}: none of --drafter {' '.join(wanted)}")
    return chosen


def evaluate_run(run_dir: Path, rows_path: Path, target_dir: Path | None, temperature: float, draft_mode: str,
                 seed: int, max_rows: int | None, max_tokens: int | None, name: str | None = None):
    """(drafter name, AcceptanceReport) of one run's drafter `name` (None: its only one) on the held-out rows."""
    import torch
    from transformers import AutoTokenizer

    from specdistill.data.formats import load_rows
    from specdistill.feature_server.config import FeatureServerConfig
    from specdistill.feature_server.server import FeatureServer
    from specdistill.evaluation.served import evaluate_as_served
    from specdistill.evaluation.reload import load_run

    target_dir = target_dir or run_target(run_dir)
    drafter, head, info = load_run(run_dir, target_dir, name)
    tokenizer = AutoTokenizer.from_pretrained(str(target_dir), local_files_only=True)
    stages: dict[int, str] = {}  # row id -> stage, numbered as the rows are (a conversation's turns each a row)
    rows, skips = load_rows(rows_path, tokenizer, info.max_position_embeddings, stages=stages)
    rows = rows[:max_rows] if max_rows else rows
    if not rows:
        raise ValueError(f"{rows_path}: no usable rows ({skips.summary()})")
    spec = drafter.feature_spec()
    with FeatureServer(str(target_dir), spec, rows, FeatureServerConfig(workers=1)) as server:
        report = evaluate_as_served(drafter, head, server, spec, torch.device("cpu"),
                                    stages=stages, temperature=temperature,
                                    draft_mode=draft_mode, seed=seed, max_generated=max_tokens)
    return name or drafter.name, report


def plot(reports: dict, path: Path, title: str) -> None:
    """a_k (left) and a_k / a_{k-1} (right) by draft position, one line per drafter."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, (ax_cum, ax_cond) = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for label, report in reports.items():
        k = range(1, report.total.K + 1)
        ax_cum.plot(k, report.total.per_position, marker="o", label=f"{label} (tau {report.total.tau:.2f})")
        ax_cond.plot(k, report.total.conditional, marker="o", label=label)
    ax_cum.set(title="cumulative acceptance a_k", xlabel="draft position k", ylabel="acceptance", ylim=(0, 1.02))
    ax_cond.set(title="conditional a_k / a_(k-1)", xlabel="draft position k")
    ax_cum.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def acceptance_reports(runs: list[Path], rows_path: Path, drafters: list[str], target_dir: Path | None,
                       temperature: float, draft_mode: str, seed: int, max_rows: int | None,
                       max_tokens: int | None) -> dict:
    """{label: AcceptanceReport} of every chosen drafter of every run (labels drafter:run, unique)."""
    reports = {}
    for run_dir in runs:
        for name in run_drafters(run_dir, drafters):
            name, report = evaluate_run(run_dir, rows_path, target_dir, temperature, draft_mode, seed, max_rows,
                                        max_tokens, name)
            reports[run_label(run_dir, name, set(reports))] = report
    return reports


def write_reports(reports: dict, out: Path, settings: dict) -> None:
    """out/acceptance.json (the settings, argv and every report) and out/acceptance.png."""
    out.mkdir(parents=True, exist_ok=True)
    payload = {**settings, "argv": sys.argv, "runs": {k: r.to_dict() for k, r in reports.items()}}
    (out / "acceptance.json").write_text(json.dumps(payload, indent=2) + "\n")
    plot(reports, out / "acceptance.png", f"{Path(settings['rows']).name}, T={settings['temperature']:g}")


def summary_lines(reports: dict) -> list[str]:
    """Per stage, then the `tau[label]: X` lines last."""
    lines = [f"by_stage[{label}]: " + " ".join(f"{s}={c.tau:.2f}" for s, c in sorted(r.by_stage.items()))
             for label, r in reports.items()]
    return lines + [f"tau[{label}]: {r.total.tau:.3f}" for label, r in reports.items()]
