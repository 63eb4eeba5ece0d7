"""Drafter registry: the key users type (`drafter=NAME`) -> (config dataclass, module class).

Adding a drafter = one module here + one file in specdistill/conf/drafter/. Listed explicitly, no import magic.
"""

from dataclasses import fields
from typing import Any

from specdistill.drafters import warm_start
from specdistill.drafters.base import Drafter
from specdistill.drafters.dflash import DFlashConfig, DFlashDrafter
from specdistill.drafters.dflash2 import DFlash2Config, DFlash2Drafter
from specdistill.drafters.dspark import DSparkConfig, DSparkDrafter
from specdistill.drafters.eagle3 import Eagle3Config, Eagle3Drafter
from specdistill.drafters.mtp import MTPConfig, MTPDrafter

DRAFTERS: dict[str, tuple[type, type[Drafter]]] = {
    "dflash": (DFlashConfig, DFlashDrafter),
    "eagle3": (Eagle3Config, Eagle3Drafter),
    "dspark": (DSparkConfig, DSparkDrafter),
    "dflash2": (DFlash2Config, DFlash2Drafter),
    "mtp": (MTPConfig, MTPDrafter),
}


def drafter_config(name: str, overrides: dict[str, Any] | None = None):
    if name not in DRAFTERS:
        raise ValueError(f"unknown drafter {name!r}; valid: {sorted(DRAFTERS)}")
    config_cls, _ = DRAFTERS[name]
    known = {f.name for f in fields(config_cls)}
    unknown = sorted(set(overrides or {}) - known)
    if unknown:
        raise ValueError(f"drafter {name!r} has no field(s) {unknown}; valid: {sorted(known)}")
    return config_cls(name=name, **{k: v for k, v in (overrides or {}).items() if k != "name"})


def build_drafter(cfg, target, tokenizer) -> Drafter:
    """Instantiate the head for `cfg.name` against a target (TargetInfo) and its tokenizer. With
    drafter.init_from=DIR the architecture is DIR's (specdistill/drafters/warm_start.py); its weights load after prepare()
    (`Drafter.load_export`)."""
    _, drafter_cls = DRAFTERS[cfg.name]
    if getattr(cfg, "init_from", None):
        cfg = warm_start.resolve_for(cfg, drafter_cls, target)
    return drafter_cls.build(cfg, target, tokenizer)


__all__ = ["DRAFTERS", "Drafter", "build_drafter", "drafter_config"]
