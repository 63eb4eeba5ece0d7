"""Structured schemas for every config group, registered with Hydra's ConfigStore, and where the configs live.

Each group file in specdistill/conf/ lists its schema first in its defaults, so an unknown or mistyped key fails
when the config is composed (torchtitan lost a run to `training.stpes`). Defaults live here, once.

The group files ship inside the package and Hydra reads them from it (CONFIG_MODULE), wherever it is installed; a
user's own directory composes over them with `--config-dir DIR` or `hydra.searchpath=[file://DIR]` (docs/launching.md,
"Your own configs").
"""

from dataclasses import dataclass, field
from typing import Any

from hydra import compose, initialize_config_module
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from specdistill.data.config import DataConfig
from specdistill.drafters import DRAFTERS
from specdistill.feature_server.config import FeatureServerConfig
from specdistill.trainer.config import TrainerConfig
from specdistill.trainer.tracking import LoggerConfig

CONFIG_MODULE = "specdistill.conf"  # the package holding config.yaml and the group folders
CONFIG_PATH = f"pkg://{CONFIG_MODULE}"  # as @hydra.main takes it


@dataclass
class TargetConfig:
    # small-real (committed, pretrained on real text: specdistill/launch/small_real.py) or a tiny target built locally:
    # tiny-qwen3-next | tiny-qwen3.5-moe | tiny-llama
    name: str | None = None
    path: str | None = None  # any local HF checkpoint dir; wins over name


@dataclass
class RunConfig:
    target: TargetConfig = field(default_factory=TargetConfig)
    drafter: Any = MISSING
    # drafters=[...]: several drafters from one prefill (specdistill/trainer/entries.py); empty: the one `drafter`
    drafters: list[Any] = field(default_factory=list)
    feature_server: FeatureServerConfig = field(default_factory=FeatureServerConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    cache_dir: str = MISSING  # tiny targets and synthetic data are built here once (specdistill/conf/config.yaml)


def run_name(drafter_name: str, drafters) -> str:
    """hydra.run.dir's drafter part (specdistill/conf/config.yaml): the drafter, or the entries' names or kinds joined by '+'."""
    if not drafters:
        return drafter_name
    return "+".join(e if isinstance(e, str) else str(e.get("name") or e.get("drafter")) for e in drafters)


def register_configs() -> None:
    OmegaConf.register_new_resolver("run_name", run_name, replace=True)
    cs = ConfigStore.instance()
    cs.store(name="run_schema", node=RunConfig)
    cs.store(group="target", name="target_schema", node=TargetConfig)
    cs.store(group="data", name="data_schema", node=DataConfig)
    cs.store(group="trainer", name="trainer_schema", node=TrainerConfig)
    cs.store(group="feature_server", name="feature_server_schema", node=FeatureServerConfig)
    cs.store(group="logger", name="logger_schema", node=LoggerConfig)
    for name, (config_cls, _) in DRAFTERS.items():
        cs.store(group="drafter", name=f"{name}_schema", node=config_cls)


def compose_config(overrides: list[str], return_hydra_config: bool = False) -> DictConfig:
    """The config `specdistill-train OVERRIDES` runs with, composed from the packaged configs (nothing runs)."""
    register_configs()
    with initialize_config_module(config_module=CONFIG_MODULE, version_base=None):
        return compose(config_name="config", overrides=overrides, return_hydra_config=return_hydra_config)
