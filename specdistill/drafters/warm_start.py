"""Warm start (`drafter.init_from=DIR`): the run's drafter starts from an existing export instead of fresh weights.

DIR is a drafter in the format vLLM serves for its method: this project's speculators-format exports (EAGLE-3,
DFlash, DSpark, DFlash 2: config.json with `speculators_config` + model.safetensors) or, for MTP, a checkpoint with
mtp.* tensors (the target's own, or an export of drafter=mtp). Two steps:

1. `resolve_config` (before the drafter is built): the architecture is read from DIR/config.json (each drafter's
   `architecture_from_export`). A field the user set (a value other than the config dataclass's default) that DIR
   contradicts stops the run naming both values; a field left at its default takes DIR's value. DIR must fit the
   target: the same hidden size and vocabulary, layer ids within its depth.
2. `load_weights` (after `prepare`): DIR's tensors replace the fresh ones, every key accounted for. EAGLE-3's reduced
   vocabulary comes from DIR too (its d2t / t2d and lm_head rows belong together), checked for staleness
   (`Eagle3Drafter.check_vocab_mapping`).

A resumed run loads its own checkpoint after this, so DIR only decides where a fresh run starts. specdistill/evaluation/reload.py
builds a finished run's drafter the same way, so DIR must still exist to reload a warm-started run.
"""

import dataclasses
import json
import logging
from pathlib import Path

import torch
from safetensors.torch import load_file

from specdistill.core.target import TargetInfo

log = logging.getLogger(__name__)


def export_config(path: str | Path) -> dict:
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"drafter.init_from={path}: no config.json there; expected a drafter export "
                                "(the export/ directory of a run, or a published drafter in the same format)")
    return json.loads(config_file.read_text())


def check_target(path, config: dict, target: TargetInfo) -> None:
    """DIR was made for a target of this hidden size and vocabulary, and reads layers this target has."""
    layer = config.get("transformer_layer_config") or config.get("text_config") or config
    hidden = config.get("target_hidden_size") or layer.get("hidden_size")
    if hidden is not None and hidden != target.hidden_size:
        raise ValueError(f"drafter.init_from={path}: made for a target of hidden size {hidden}, but the target "
                         f"{target.path} has hidden size {target.hidden_size}")
    vocab = layer.get("vocab_size")
    if vocab is not None and vocab != target.vocab_size:
        raise ValueError(f"drafter.init_from={path}: made for a vocabulary of {vocab} tokens, but the target "
                         f"{target.path} has {target.vocab_size}")


def resolve_config(cfg, architecture: dict, path, target: TargetInfo):
    """cfg with DIR's architecture; a user-set field DIR contradicts is an error naming both values."""
    defaults = {f.name: (f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default)
                for f in dataclasses.fields(cfg)}
    conflicts = [f"drafter.{k}={getattr(cfg, k)!r} but {path}/config.json has {v!r}"
                 for k, v in architecture.items()
                 if getattr(cfg, k) != defaults[k] and _normal(getattr(cfg, k)) != _normal(v)]
    if conflicts:
        raise ValueError("drafter.init_from: the run's drafter settings contradict the export it starts from: "
                         + "; ".join(conflicts) + ". Drop those overrides (the export's values are used) or start "
                         "from another export")
    layer_ids = architecture.get("target_layer_ids") or []
    too_deep = [i for i in layer_ids if not 0 < i <= target.num_hidden_layers]
    if too_deep:
        raise ValueError(f"drafter.init_from={path}: reads target layers {layer_ids}, but the target {target.path} "
                         f"has {target.num_hidden_layers} layers (ids 1..{target.num_hidden_layers})")
    return dataclasses.replace(cfg, **architecture)


def resolve_for(cfg, drafter_cls, target: TargetInfo):
    """Both checks and the resolved config, for drafters.build_drafter."""
    config = export_config(cfg.init_from)
    theirs, ours = config.get("speculators_model_type"), getattr(drafter_cls, "speculators_model_type", None)
    if theirs is not None and theirs != ours:
        raise ValueError(f"drafter.init_from={cfg.init_from}: a {theirs!r} export, but the run trains "
                         f"drafter={cfg.name} ({ours or 'not a speculators format'})")
    check_target(cfg.init_from, config, target)
    return resolve_config(cfg, drafter_cls.architecture_from_export(config), cfg.init_from, target)


def _normal(value):
    return list(value) if isinstance(value, tuple) else value


def load_weights(drafter: torch.nn.Module, path, optional: frozenset = frozenset(),
                 ignored: frozenset = frozenset()) -> None:
    """DIR/model.safetensors into the drafter, cast to its parameters' dtypes. Every tensor must be one of the
    drafter's and every drafter tensor must be there, except `optional` ones (kept as built); `ignored` ones in
    the file are skipped (logged)."""
    file = Path(path) / "model.safetensors"
    if not file.is_file():
        raise FileNotFoundError(f"drafter.init_from={path}: no model.safetensors there")
    tensors = load_file(str(file))
    skipped = sorted(set(tensors) & ignored)
    if skipped:
        log.info("drafter.init_from=%s: not loading %s (the target's own are used)", path, skipped)
        tensors = {k: v for k, v in tensors.items() if k not in ignored}
    own = drafter.state_dict()
    unexpected = sorted(set(tensors) - set(own))
    missing = sorted(set(own) - set(tensors) - optional)
    if unexpected or missing:
        raise ValueError(f"drafter.init_from={path}: its tensors do not fit this drafter: unexpected "
                         f"{unexpected[:8]}, missing {missing[:8]} (an export of another drafter or version?)")
    mismatched = [f"{k}: {tuple(v.shape)} vs {tuple(own[k].shape)}" for k, v in tensors.items()
                  if v.shape != own[k].shape]
    if mismatched:
        raise ValueError(f"drafter.init_from={path}: tensor shapes differ from the drafter its config.json "
                         f"describes: {mismatched[:6]}")
    drafter.load_state_dict({k: v.to(own[k].dtype) for k, v in tensors.items()}, strict=False)
    log.info("drafter.init_from=%s: loaded %d tensors", path, len(tensors))
