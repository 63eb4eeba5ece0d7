"""Several drafters from one stream of target states: the run's entries, and what the trainer keeps for each.

The target's prefill is the expensive side of a node, so a run may train several drafters on the same packs
(`drafters=[...]`, README.md "Several drafters in one run"). Each entry is one drafter with its own name, drafter
settings and trainer settings (learning rates, schedule, clipping, feature ablation), and gets what its solo run
would get: the global RNG reseeded with trainer.seed before it is built, a generator seeded as a solo run's, its own
optimizers and schedule, the same read-only packs (tests/test_many_drafters.py checks the weights equal a solo
run's). Entries step in turn on each pack.

An entry on the command line is a drafter config name (`dflash`), or a mapping:
    {drafter: dflash, name: dflash_b16, block_size: 16, trainer: {lr: 0.001, feature_ablation: zero}}
`drafter` is the kind (specdistill/conf/drafter/NAME.yaml); `name` the entry's name (default: the kind, then kind_2, kind_3 for
repeats), used for export/<name>/, its metrics and its wandb series; `trainer` a subset of the trainer settings
(ENTRY_TRAINER_KEYS); every other key is a field of that drafter's config.

A checkpoint records each entry by name (Entry.record): its kind, layer ids, drafter config and its own trainer
settings; a resume refuses an entry whose record differs (specdistill/trainer/checkpoint.py), so the same entries in
another order, which renames them, never load each other's weights.
"""

import re
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from specdistill.core.shapes import StaticShapes
from specdistill.drafters import drafter_config
from specdistill.trainer.config import TrainerConfig
from specdistill.trainer.metrics import StepMetrics
from specdistill.trainer.validation import ValidationState

# Trainer settings an entry may set for itself; the rest (steps, packs, precision, ranks, ...) are the run's.
ENTRY_TRAINER_KEYS = ("lr", "muon_lr", "muon_scope", "weight_decay", "warmup_steps", "final_lr_fraction",
                      "grad_clip", "feature_ablation")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


@dataclass
class EntrySpec:
    """One entry, resolved: its name, its drafter config (a drafters/ config dataclass) and its trainer settings
    (the run's, with `own_trainer`, what the entry sets for itself, over them)."""

    name: str
    drafter: Any
    trainer: TrainerConfig
    own_trainer: dict = field(default_factory=dict)


def resolve_entries(entries: list, drafter_cfg, trainer_cfg: TrainerConfig) -> list[EntrySpec]:
    """`drafters=[...]` (empty: the run's one `drafter`, under its own name) -> EntrySpecs with unique names."""
    if not entries:
        return [EntrySpec(drafter_cfg.name, drafter_cfg, trainer_cfg)]
    specs, taken = [], {}
    for i, entry in enumerate(entries):
        kind, name, drafter_overrides, trainer_overrides = _parse(entry, i)
        if name is None:
            taken[kind] = taken.get(kind, 0) + 1
            name = kind if taken[kind] == 1 else f"{kind}_{taken[kind]}"
        specs.append(EntrySpec(name, drafter_config(kind, drafter_overrides),
                               replace(trainer_cfg, **trainer_overrides), trainer_overrides))
    names = [s.name for s in specs]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"drafters: entry names {repeated} are used twice; give each entry its own name "
                         "({drafter: KIND, name: NAME, ...}); names are export/<name>/ directories")
    return specs


def _parse(entry, index: int) -> tuple[str, str | None, dict, dict]:
    where = f"drafters[{index}]"
    if isinstance(entry, str):
        return entry, None, {}, {}
    if not isinstance(entry, dict) or "drafter" not in entry:
        raise ValueError(f"{where}={entry!r}: expected a drafter name (dflash) or a mapping with its kind, e.g. "
                         "{drafter: dflash, name: dflash_b16, block_size: 16, trainer: {lr: 0.001}}")
    entry = dict(entry)
    kind, name, trainer = entry.pop("drafter"), entry.pop("name", None), entry.pop("trainer", None) or {}
    if name is not None and not _NAME.fullmatch(str(name)):
        raise ValueError(f"{where}: name {name!r} must be letters, digits, '_', '-' or '.' (it names export/<name>/)")
    unknown = sorted(set(trainer) - set(ENTRY_TRAINER_KEYS))
    if unknown:
        raise ValueError(f"{where}: trainer settings {unknown} cannot differ between entries of one run; an entry "
                         f"may set {list(ENTRY_TRAINER_KEYS)}")
    return str(kind), (str(name) if name is not None else None), entry, dict(trainer)


@dataclass
class Entry:
    """One drafter of the run as the trainer holds it: built once, stepped on every pack until it stops."""

    spec: EntrySpec
    drafter: Any  # the Drafter (unwrapped: weights, export)
    model: Any  # what the step calls: the drafter, wrapped for DDP/FSDP or compiled
    optimizers: Any
    generator: torch.Generator
    input_layer_ids: list[int]
    static: StaticShapes
    window: StepMetrics
    totals: StepMetrics
    since_validation: StepMetrics
    validation: ValidationState = field(default_factory=ValidationState)
    validator: Any = None
    train_seconds: float = 0.0  # this entry's share of the steps' time
    steps: int = 0  # optimizer steps taken (less than the run's when it stopped early)
    packs: int = 0  # packs stepped on by this process (anchors_per_pack; not checkpointed, as `totals`)
    last_loss: float = float("nan")
    stopped: dict | None = None  # {"step", "last_finite_loss", "loss", "why"} once its loss went non-finite

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def cfg(self) -> TrainerConfig:
        return self.spec.trainer

    @property
    def active(self) -> bool:
        return self.stopped is None

    def record(self) -> dict:
        """What a checkpoint records of this entry: what evaluation/reload.py builds, and what a resume compares
        (specdistill/trainer/checkpoint.py check_entry)."""
        return {"drafter": self.spec.drafter.name, "target_layer_ids": list(self.drafter.feature_spec().layer_ids),
                "config": asdict(self.spec.drafter), "trainer": dict(self.spec.own_trainer)}

    def state(self) -> dict:
        """What a checkpoint keeps of this entry besides weights and optimizers (per rank)."""
        return {"train_seconds": self.train_seconds, "steps": self.steps, "last_loss": self.last_loss,
                "stopped": self.stopped}

    def load_state(self, saved: dict) -> None:
        self.train_seconds, self.steps = saved["train_seconds"], saved["steps"]
        self.last_loss, self.stopped = saved["last_loss"], saved["stopped"]
