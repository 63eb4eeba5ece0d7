"""metrics.json and the printed summary: per drafter, once for the run, and the model-free baselines beside them.

One drafter (`drafter=NAME`) keeps the flat metrics.json it always had (README.md "The main job"), with the run's
fields and the drafter's side by side. Several (`drafters=[...]`) put each drafter's under `drafters.<name>` and add
the comparison table: tau_offline, a_1, per-stage acceptance, steps, training seconds, whether it stopped early, and
the bigram and n-gram baselines on the same held-out rows, with the run's extraction seconds and target tokens once.
"""

from dataclasses import asdict

from specdistill.kernels.attention.flex import compiled_graphs
from specdistill.trainer.device_copy import pinned_host_peak_bytes


def entry_metrics(entry, report, selection_tau, split, selected: dict, export_dir, final_loss: float) -> dict:
    """One drafter's part of metrics.json. report: its held-out AcceptanceReport (None without held-out rows);
    final_loss: its last step's loss, the mean over ranks."""
    counts, curve = (report.total if report else None), entry.validation.curve
    return {
        "name": entry.name,
        "drafter": entry.spec.drafter.name,
        "steps": entry.steps,
        "stopped_early": entry.stopped,
        "final_loss": final_loss,
        "train_accuracy_per_position": entry.totals.summary()["accuracy_per_position"],
        "tau_offline": counts.tau if counts else None,
        "tau_offline_selection_rows": selection_tau,
        "heldout_split": split,
        "per_position_acceptance": counts.per_position if counts else None,
        "conditional_acceptance": counts.conditional if counts else None,
        "heldout_drafts": counts.num_drafts if counts else 0,
        "heldout_target_disagreement": counts.disagreement_fraction if counts else None,
        "heldout_rows_too_short": counts.rows_too_short if counts else 0,
        "heldout_curve": curve,
        "train_vs_heldout_gap": curve[-1]["gap"] if curve else None,
        "export_selected": selected,
        "acceptance_by_stage": ({s: c.to_dict() for s, c in sorted(report.by_stage.items())} if report else None),
        "num_speculative_tokens": entry.drafter.num_speculative_tokens,
        "training_seconds": entry.train_seconds,
        # Anchor blocks scored per pack (DFlash family: sampled up to drafter.max_anchors; EAGLE-3, MTP: chains).
        "anchors_per_pack": float(entry.totals.blocks) / max(1, entry.packs),
        "compiled_shapes": entry.static.count,
        "anchor_pad_fraction": entry.static.query_pad_fraction,
        "export_dir": str(export_dir),
    }


def run_metrics(state, *, target, pack_tokens: int, wait_fraction: float, first_step_seconds, engine_loads: float,
                eval_seconds: float, train_skips, heldout_skips, pad_packs: bool, pinned_pool_bytes: int,
                max_open_packs: int, positions: dict | None = None) -> dict:
    """The run's part: the stream of packs and what extracting it cost, once however many drafters trained."""
    return {
        "target": str(target.path),
        "target_model_type": target.model_type,
        "steps": state.step,
        "epochs_completed": state.epoch,
        "train_tokens": state.train_tokens,
        "packs": state.packs,
        "pack_tokens": pack_tokens,
        "pack_fill": state.train_tokens / max(1, state.packs * pack_tokens),
        "rows_per_pack": state.train_rows / max(1, state.packs),
        "train_response_tokens": state.train_response_tokens,
        # Pay only for what is read (docs/scaling.md "What ships"): target-state bytes shipped per response token
        # trained, and response tokens trained per second of training steps (all drafters of the run).
        "feature_bytes_per_response_token": state.feature_bytes / max(1, state.train_response_tokens),
        "response_tokens_per_second": state.train_response_tokens / max(1e-9, state.train_seconds),
        "positions": positions,
        "target_tokens_prefilled": state.target_tokens,
        "feature_extraction_seconds": state.feature_seconds,
        "feature_wait_seconds": state.feature_wait_seconds,
        "feature_wait_fraction": wait_fraction,
        "first_step_seconds": first_step_seconds,
        "engine_loads_per_worker": engine_loads,
        "samples_duplicated": state.samples_duplicated,
        "samples_lost": state.samples_lost,
        "rows_reissued": state.rows_reissued,
        "duplicate_deliveries_dropped": state.duplicate_deliveries_dropped,
        "feature_workers_died": state.feature_workers_died,
        "training_seconds": state.train_seconds,
        "eval_seconds": eval_seconds,
        "rows_truncated": train_skips.truncated,
        "skipped_rows": {"train": asdict(train_skips), "heldout": asdict(heldout_skips) if heldout_skips else None},
        # Fixed shapes (core/shapes.py): padding's share of the packs' laid-out tokens (on CPU, what padding would
        # add), and the graphs dynamo really compiled for attention, beside each drafter's compiled_shapes (the plans'
        # own count; kernels/attention/flex.py; all 0 on CPU, where nothing is compiled).
        "pad_packs": pad_packs,
        "pad_fraction": 1 - state.train_tokens / max(1, state.packs * pack_tokens),
        "compiled_graphs": compiled_graphs(),
        # Host memory of the pinned pack pool (trainer/device_copy.py; 0 on CPU): what the pool asked for at most,
        # and what torch's caching host allocator really pinned (each block rounded up to a power of two, freed
        # ones kept for reuse).
        "pinned_pool_mib": pinned_pool_bytes / 2**20,
        "pinned_host_mib": pinned_host_peak_bytes() / 2**20,
        "max_open_packs": max_open_packs,
    }


def summary_lines(drafters: dict[str, dict], baselines_by_K: dict) -> list[str]:
    """The comparison table the run prints last: one line per drafter, then the baselines (at each drafter K,
    named by K where the drafters' differ)."""
    lines = [f"{'':<22}{'tau':>7}{'a_1':>7}{'steps':>7}{'train s':>9}  stopped early"]
    for name, m in drafters.items():
        tau, a_1 = m["tau_offline"], (m["per_position_acceptance"] or [None])[0]
        stopped = f"at step {m['stopped_early']['step']}" if m["stopped_early"] else "no"
        lines.append(f"{name:<22}{_num(tau):>7}{_num(a_1):>7}{m['steps']:>7}{m['training_seconds']:>9.1f}  {stopped}")
    for K, baselines in sorted(baselines_by_K.items()):
        for name, b in baselines.items():
            label = f"{name} baseline" + (f" K={K}" if len(baselines_by_K) > 1 else "")
            lines.append(f"{label:<22}{_num(b['tau']):>7}{_num(b['per_position'][0]):>7}")
    return lines


def _num(x) -> str:
    return "-" if x is None else f"{x:.3f}"
