"""Offline acceptance of trained drafters on held-out rows: JSON per drafter and per stage, plus one plot.

    python -m specdistill.evaluation.offline_acceptance --run RUN_DIR [--run RUN_DIR2 ...] --rows heldout.jsonl --out DIR \
        [--drafter NAME ...] [--temperature 0] [--draft-mode greedy|sample] [--seed 0] [--max-rows N]
        [--max-tokens N] [--target DIR]

Each run dir is a finished (or interrupted) training run (specdistill.evaluation.reload.load_run: its last checkpoint);
every drafter it trained is evaluated (a `drafters=[...]` run has several), or those named by --drafter. The
target defaults to the one the run trained against (metrics.json "target", else the resolved config). Writes
DIR/acceptance.json ({"runs": {label: report}}, report = tau, per_position a_k, conditional a_k/a_{k-1}, counters,
by_stage) and DIR/acceptance.png (a_k and conditional acceptance by position, one line per drafter), and prints
`tau[label]: X` lines. The walk and the T > 0 rule are specdistill.evaluation.acceptance's (the same code as metrics.json's
tau_offline).
"""

from __future__ import annotations

import argparse
import json
import os
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", action="append", required=True, type=Path, help="training run dir (repeatable)")
    ap.add_argument("--rows", required=True, type=Path, help="held-out JSONL (specdistill/data/synthetic.py rows)")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--drafter", action="append", default=[],
                    help="of a drafters=[...] run, the drafter to evaluate by its name (repeatable; default: all)")
    ap.add_argument("--target", type=Path, default=None, help="default: the target each run trained against")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--draft-mode", default="greedy", choices=("greedy", "sample"),
                    help="T > 0: greedy drafts (as vLLM) or drafts sampled from the draft distribution")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-rows", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=None, help="stop each response after N tokens (max_tokens)")
    args = ap.parse_args(argv)
    reports = {}
    for run_dir in args.run:
        for name in run_drafters(run_dir, args.drafter):
            name, report = evaluate_run(run_dir, args.rows, args.target, args.temperature, args.draft_mode,
                                        args.seed, args.max_rows, args.max_tokens, name)
            reports[run_label(run_dir, name, set(reports))] = report
    args.out.mkdir(parents=True, exist_ok=True)
    payload = {"rows": str(args.rows), "temperature": args.temperature, "draft_mode": args.draft_mode,
               "seed": args.seed, "argv": sys.argv, "runs": {k: r.to_dict() for k, r in reports.items()}}
    (args.out / "acceptance.json").write_text(json.dumps(payload, indent=2) + "\n")
    plot(reports, args.out / "acceptance.png", f"{args.rows.name}, T={args.temperature:g}")
    for label, report in reports.items():
        stages = " ".join(f"{s}={c.tau:.2f}" for s, c in sorted(report.by_stage.items()))
        print(f"by_stage[{label}]: {stages}")
    for label, report in reports.items():
        print(f"tau[{label}]: {report.total.tau:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
