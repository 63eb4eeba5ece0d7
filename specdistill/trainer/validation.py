"""Held-out acceptance during training: the curve, the train-vs-held-out gap, and the best weights.

Every `trainer.eval_every` steps rank 0 walks the greedy decode path (specdistill/evaluation/acceptance.py) on the held-out
rows, and on as many training rows (the "probe"), with the drafter cast to the dtype its export is served in
(specdistill/evaluation/served.py). Both sets' target states are extracted once, when training starts, and kept in memory
(`eval_rows` rows each), so an evaluation costs drafter passes only. The progress bar's tau is an estimate on
training batches; the held-out walk is what vLLM will see, and the probe walk next to it shows overfitting (a
rising gap) while it happens.

The export is the weights with the best held-out tau (`trainer.export=best`, the default) or the last ones
(`export=last`). The best weights travel in every checkpoint, so a resumed run keeps them. The held-out rows are
split in two (alternate rows): the curve, and so the choice of the best weights, walks the selection half; the
headline `tau_offline` walks the export on the other half, which the choice never saw, so picking the best of
several points does not flatter it (`tau_offline_selection_rows` is the same export on the selection half). With a
single held-out row there is nothing to split: both walk it, and metrics.json says so.
"""

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from specdistill.core.rows import Rows, as_rows
from specdistill.evaluation.served import evaluate_as_served

EXPORT_POLICIES = ("best", "last")


@dataclass
class ValidationState:
    """What a checkpoint keeps of validation: the curve so far and the best weights."""

    curve: list[dict] = field(default_factory=list)
    best_step: int | None = None
    best_tau: float | None = None
    best_weights: dict[str, torch.Tensor] | None = None

    def to_checkpoint(self) -> dict:
        return {"curve": self.curve, "best_step": self.best_step, "best_tau": self.best_tau,
                "best_weights": self.best_weights}

    @classmethod
    def from_checkpoint(cls, entry: dict | None) -> "ValidationState":
        return cls(**entry) if entry else cls()


class Validator:
    """Rank 0's held-out walks. `heldout` and `probe` are lists of FeatureSamples owned by this object."""

    def __init__(self, heldout: list, probe: list, spec, device: torch.device,
                 state: ValidationState, stages: dict[int, str] | None = None, static=None):
        """spec: what the samples ship (core/contract.py FeatureSpec); static: the run's fixed shapes (core/shapes.py):
        each walked row is laid out over a length bucket (StaticShapes.walk_tokens)."""
        self.heldout, self.probe, self.spec, self.device = heldout, probe, spec, device
        self.static = static
        self.state, self.stages = state, stages
        self.selection, self.reported = split_heldout(heldout)

    def walk(self, drafter, head, samples, stages=None):
        return evaluate_as_served(drafter, head, samples, self.spec, self.device, stages=stages,
                                  static=self.static)

    def run(self, drafter, head, step: int, train_tokens: int, train_seconds: float,
            train_tau_estimate: float) -> dict:
        """Walk held-out and probe rows now; record the point; keep the weights if they are the best so far.
        train_seconds: time spent in training steps so far (no feature waits, no walks), so a curve can be read
        at a time budget ("held-out tau after 30 minutes of training")."""
        heldout = self.walk(drafter, head, self.selection).total
        probe = self.walk(drafter, head, self.probe).total if self.probe else None
        point = {"step": step, "train_tokens": train_tokens, "training_seconds": train_seconds,
                 "heldout_tau": heldout.tau,
                 "heldout_per_position": heldout.per_position,
                 "train_rows_tau": probe.tau if probe else None,
                 "gap": (probe.tau - heldout.tau) if probe else None,
                 "train_tau_estimate": None if math.isnan(train_tau_estimate) else train_tau_estimate}
        self.state.curve.append(point)
        if self.state.best_tau is None or heldout.tau > self.state.best_tau:
            self.state.best_step, self.state.best_tau = step, heldout.tau
            self.state.best_weights = {k: v.detach().to("cpu", copy=True) for k, v in drafter.state_dict().items()}
        return point

    def report(self, drafter, head):
        """The final held-out report (per stage too) of `drafter` as served, on the rows the choice of the best
        weights never saw."""
        return self.walk(drafter, head, self.reported, self.stages)

    def on_selection_rows(self, drafter, head):
        return self.walk(drafter, head, self.selection).total

    @property
    def split(self) -> dict:
        return {"selection_rows": len(self.selection), "report_rows": len(self.reported),
                "split": self.selection is not self.reported}


def split_heldout(samples: list) -> tuple[list, list]:
    """(selection rows, report rows): alternate rows in row-id order; one row serves both when there is one."""
    ordered = sorted(samples, key=lambda s: s.row_id)
    if len(ordered) < 2:
        return ordered, ordered
    return ordered[0::2], ordered[1::2]


def resolve_eval_every(eval_every: int | None, max_steps: int) -> int:
    """trainer.eval_every, with None = 5 points over the run (at most 500 steps apart)."""
    return max(1, min(500, max_steps // 5)) if eval_every is None else eval_every


def check_eval_settings(eval_every: int, max_steps: int, export: str) -> None:
    if export not in EXPORT_POLICIES:
        raise ValueError(f"trainer.export={export!r}; valid: {', '.join(EXPORT_POLICIES)}")
    if eval_every < 0:
        raise ValueError(f"trainer.eval_every={eval_every}: need >= 0 (0 = held-out acceptance at the end only)")
    if eval_every > max_steps:
        raise ValueError(f"trainer.eval_every={eval_every} is larger than trainer.max_steps={max_steps}: held-out "
                         "acceptance would never be measured during training; set trainer.eval_every <= "
                         "trainer.max_steps, or 0 to measure at the end only")


def usable_heldout(rows, path) -> Rows:
    """Held-out rows a draft step fits in (>= 2 response tokens), as an index (a token store's rows stay on disk);
    an error when none is left."""
    rows = as_rows(rows)
    usable = rows.take(np.flatnonzero(rows.response_tokens() >= 2))
    if len(rows) and not len(usable):
        raise ValueError(f"{path}: no held-out row has a response of >= 2 tokens, so no draft step can be scored "
                         "(rows that are all prompt are skipped when loaded); give rows with responses")
    return usable
