"""The main job: specdistill-train drafter=NAME target=NAME|target.path=DIR [key=value ...]
(several drafters from one prefill: drafters=[NAME,NAME,...], specdistill/trainer/entries.py)

Hydra composes specdistill/conf/ (strict schemas, specdistill/launch/config.py), this builds the Trainer and runs it. The run
directory (hydra.run.dir) ends with export/ (export/<name>/ per drafter of a drafters=[...] run) and metrics.json;
re-running with the same directory resumes from its last checkpoint.
"""

import os

# Before torch loads OpenMP, for this process and the feature workers it spawns: threads that wait at a barrier
# sleep instead of spinning, so trainer ranks and CPU feature workers sharing cores slow each other by their
# share, not by a whole preempted op (2 cores: 4.1 s vs 30 s per DFlash step; docs/scaling.md, "CPU threads").
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import faulthandler  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import signal  # noqa: E402
from pathlib import Path  # noqa: E402

import hydra  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402

from specdistill.core.process_exit import exit_now  # noqa: E402
from specdistill.launch.command import own_flags_of_sys_argv  # noqa: E402
from specdistill.launch.config import CONFIG_PATH, register_configs  # noqa: E402

# The trainer, the data preparation and the launchers are imported inside the functions that use them: every process
# spawned under this command (feature workers, and the vLLM engine-core and worker processes they start) imports the
# command's own module first (multiprocessing's spawn re-imports __main__), and the trainer's imports (transformers'
# models among them) cost each of them ~2-4 s of CPU for nothing. A tiny-llama run with vLLM features on 2 cores:
# 64 s -> 50 s (docs/launching.md, "Process start-up").

log = logging.getLogger("specdistill")
register_configs()


# The configs inside the installed package (specdistill/conf/), found wherever it is installed; `--config-dir DIR`
# adds a user's own (docs/launching.md, "Your own configs").
@hydra.main(config_path=CONFIG_PATH, config_name="config", version_base=None)
def main(cfg: DictConfig) -> dict:
    from specdistill.data.token_store import open_store
    from specdistill.launch.prepare import resolve_data, resolve_target
    from specdistill.trainer.run_info import changes_on_resume, write_run_info
    from specdistill.trainer.trainer import Trainer

    os.umask(0o077)  # checkpoints, exports, logs and shared memory of a run are private to its user
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID`: every thread's stack to stderr
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    cache_dir = Path(cfg.cache_dir).expanduser()
    # Built (or found in the cache) before any rank starts, so ranks never race to build them.
    target_dir = resolve_target(OmegaConf.to_object(cfg.target), cache_dir)
    data_cfg = OmegaConf.to_object(cfg.data)
    train_path, heldout_path = resolve_data(data_cfg, target_dir, cache_dir)
    if "LOCAL_RANK" not in os.environ:  # tokenized once per node, before any rank starts (ranks map it)
        for path in (train_path, heldout_path):
            if path:
                open_store(path, target_dir, cache_dir, workers=data_cfg.tokenize_workers,
                           progress=cfg.trainer.progress, cfg=data_cfg)
    if cfg.trainer.ranks > 1 and "LOCAL_RANK" not in os.environ:
        return _relaunch_as_ranks(cfg.trainer.ranks, run_dir)
    _adopt_torchrun_sizes(cfg)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    if int(os.environ.get("RANK", "0")) == 0:  # rank 0 writes the run dir's records (docs/launching.md)
        changed = changes_on_resume(run_dir, resolved)
        for change in changed:  # resuming is right after a crash; a changed setting is the user's to know about
            log.warning("resuming %s with a setting changed from the run's own (run_info.json): %s", run_dir, change)
        write_run_info(run_dir, resolved, changed)
    entries = OmegaConf.to_container(cfg.drafters, resolve=True)
    _check_drafter_overrides(entries)
    trainer = Trainer(
        entries=entries,
        drafter_cfg=OmegaConf.to_object(cfg.drafter),
        trainer_cfg=OmegaConf.to_object(cfg.trainer),
        server_cfg=OmegaConf.to_object(cfg.feature_server),
        run_dir=run_dir,
        target_dir=target_dir,
        train_path=train_path,
        heldout_path=heldout_path,
        resolved_config=resolved,
        data_cfg=data_cfg,
        cache_dir=cache_dir,
    )
    metrics = trainer.train()
    if metrics:
        exports = ({n: m["export_dir"] for n, m in metrics["drafters"].items()} if "drafters" in metrics
                   else metrics["export_dir"])
        log.info("export: %s", exports)
        log.info("metrics: %s", json.dumps({k: metrics.get(k) for k in ("steps", "tau_offline", "training_seconds",
                                                                       "feature_extraction_seconds")}))
    return metrics


def _check_drafter_overrides(entries: list) -> None:
    """drafters=[...] takes each drafter's settings from its entry: a `drafter=` or `drafter.X=` beside it would
    apply to nothing, so it is refused rather than silently ignored."""
    explicit = [o for o in HydraConfig.get().overrides.task if o.lstrip("+~").split("=")[0].split(".")[0] == "drafter"]
    if entries and explicit:
        raise ValueError(f"{explicit} with drafters=[...]: each entry carries its own drafter settings, e.g. "
                         "drafters=[dflash,{drafter:dflash,name:dflash_b16,block_size:16}] (README.md, \"Several "
                         "drafters in one run\")")



def _adopt_torchrun_sizes(cfg: DictConfig) -> None:
    """Under torchrun: trainer.ranks = its processes per node, feature_server.workers >= one per rank, unless the
    command line set them (specdistill/trainer/layout.py torchrun_sizes)."""
    from specdistill.trainer.layout import torchrun_sizes

    world = os.environ.get("LOCAL_WORLD_SIZE")
    explicit = {o.split("=", 1)[0].lstrip("+~") for o in HydraConfig.get().overrides.task}
    ranks, workers = torchrun_sizes(cfg.trainer.ranks, cfg.feature_server.workers, int(world) if world else None,
                                    explicit)
    if (ranks, workers) != (cfg.trainer.ranks, cfg.feature_server.workers):
        log.info("torchrun: %s processes on this node -> trainer.ranks=%d, feature_server.workers=%d (was %d, %d)",
                 world, ranks, workers, cfg.trainer.ranks, cfg.feature_server.workers)
        cfg.trainer.ranks, cfg.feature_server.workers = ranks, workers


def _relaunch_as_ranks(ranks: int, run_dir: Path) -> dict:
    """trainer.ranks > 1 from a plain `specdistill-train`: start the ranks on this node with torchrun's
    environment (specdistill/launch/ranks.py; rendezvous on 127.0.0.1 only), with the run dir fixed so that every rank
    (and a later resume) writes to the same place."""
    from specdistill.core.run_dir import RunDir
    from specdistill.launch.ranks import launch_local

    overrides = [o for o in HydraConfig.get().overrides.task if not o.startswith("hydra.run.dir=")]
    code = launch_local(ranks, [*overrides, f"hydra.run.dir={run_dir}"])
    if code:
        raise SystemExit(f"{ranks} trainer ranks: a rank failed (exit code {code}); see the log above. The run "
                         f"resumes from its last checkpoint in {run_dir} when started again")
    metrics_file = RunDir(run_dir).metrics
    return json.loads(metrics_file.read_text()) if metrics_file.is_file() else {}


def cli() -> None:
    """The `specdistill-train` command (main's metrics dict is not an exit status). `--version` (the package's, not
    Hydra's) and `--verbose` are taken before Hydra parses the rest; `--help` stays Hydra's (the config groups)."""
    own_flags_of_sys_argv()
    main()
    exit_now(0)  # the run is written and closed: no interpreter teardown (docs/launching.md, "Process start-up")


if __name__ == "__main__":
    cli()
