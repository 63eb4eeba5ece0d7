"""Resolve what a run trains on: the target checkpoint dir and the train/held-out JSONL files.

Tiny targets and synthetic workloads are built once into the cache and reused (keyed by the target's
fingerprint and the workload settings), so re-runs and resumes never regenerate them.
"""

import hashlib
import json
import shutil
from pathlib import Path

from specdistill.core.build_lock import build_lock, dead_scratch, publish_dir, scratch_name
from specdistill.data.corpus_workload import CorpusWorkload, make_corpus_workload
from specdistill.data.generate import resolve_backend
from specdistill.launch.config import DataConfig, TargetConfig
from specdistill.launch.assets import SMALL_REAL_DIR
from specdistill.launch.targets import TINY_TARGETS, ensure_target
from specdistill.data.synthetic import make_workload

# Targets committed to the repository (name -> checkpoint dir), beside the tiny ones built on first use.
COMMITTED_TARGETS = {"small-real": SMALL_REAL_DIR}
DATA_SOURCES = ("synthetic", "corpus", "jsonl")


def resolve_target(cfg: TargetConfig, cache_dir: Path) -> Path:
    if cfg.path:
        path = Path(cfg.path).expanduser()
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"target.path={cfg.path}: no config.json there; expected a local HF checkpoint dir")
        return path
    if not cfg.name:
        raise ValueError("set target=NAME (a tiny target) or target.path=DIR (a local HF checkpoint)")
    if cfg.name in COMMITTED_TARGETS:
        path = COMMITTED_TARGETS[cfg.name]
        if not (path / "model.safetensors").is_file():
            raise FileNotFoundError(f"target={cfg.name}: {path}/model.safetensors is missing from this installation of "
                                    f"specdistill (its wheel ships it); rebuild it with `specdistill-make-target "
                                    f"{cfg.name} {path}`")
        return path
    if cfg.name not in TINY_TARGETS:
        raise ValueError(f"unknown target {cfg.name!r}; valid names: "
                         f"{', '.join([*COMMITTED_TARGETS, *TINY_TARGETS])} (or target.path=DIR)")
    return ensure_target(cfg.name, cache_dir / "targets")


def target_fingerprint(target_dir: Path) -> str:
    """Config bytes + weight file names and sizes: cheap, and changes whenever the checkpoint does."""
    h = hashlib.sha256((target_dir / "config.json").read_bytes())
    for f in sorted(target_dir.glob("*.safetensors")):
        h.update(f"{f.name}:{f.stat().st_size}".encode())
    return h.hexdigest()[:12]


def resolve_data(cfg: DataConfig, target_dir: Path, cache_dir: Path) -> tuple[Path, Path | None]:
    if cfg.source == "jsonl":
        if not cfg.train_path:
            raise ValueError("data=jsonl needs data.train_path=FILE.jsonl (and usually data.heldout_path)")
        heldout = Path(cfg.heldout_path) if cfg.heldout_path else None
        return Path(cfg.train_path), heldout
    if cfg.source not in DATA_SOURCES:
        raise ValueError(f"data.source={cfg.source!r}; valid: {', '.join(DATA_SOURCES)}")
    # The backend is part of the key: a bf16 hybrid target's greedy rows can differ between engines on near-ties.
    rows = cfg.rows + cfg.heldout_rows
    backend = resolve_backend(cfg.generation_backend, target_dir, rows * cfg.prompt_tokens, rows)
    settings = [cfg.rows, cfg.heldout_rows, cfg.prompt_tokens, cfg.max_new_tokens, cfg.seed, backend]
    if cfg.source == "corpus":
        settings = ["corpus", *settings, cfg.prompt_min_tokens]
    elif cfg.prompt_spread:
        settings.append(cfg.prompt_spread)
    if cfg.source == "synthetic" and cfg.chat_template_kwargs:  # they change the prompts (keys without them stay)
        settings.append(dict(cfg.chat_template_kwargs))
    key = json.dumps([target_fingerprint(target_dir), *settings])
    out_dir = cache_dir / "workloads" / hashlib.sha256(key.encode()).hexdigest()[:12]
    train, heldout = out_dir / "train.jsonl", out_dir / "heldout.jsonl"
    if workload_complete(out_dir):
        return train, heldout
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with build_lock(out_dir):  # concurrent runs sharing the cache wait for one generator
        if not workload_complete(out_dir):
            # Generated in a directory of its own and published by one rename: a reader never sees train.jsonl
            # without its heldout.jsonl, and a complete workload is never replaced under it.
            for leftover in dead_scratch(out_dir):  # a killed build's directory (this host's; the lock is ours)
                shutil.rmtree(leftover, ignore_errors=True)
            scratch = scratch_name(out_dir)
            try:
                _make_data(cfg, backend, target_dir, scratch)
                publish_dir(scratch, out_dir, workload_complete)
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
    return train, heldout


def workload_complete(out_dir: Path) -> bool:
    """A generated workload is whole once its meta file is there (written last)."""
    return all((out_dir / f).is_file() for f in ("train.jsonl", "heldout.jsonl", "workload_meta.json"))


def _make_data(cfg: DataConfig, backend: str, target_dir: Path, out_dir: Path) -> tuple[Path, Path]:
    if cfg.source == "corpus":
        return make_corpus_workload(target_dir, out_dir, CorpusWorkload(
            rows=cfg.rows, heldout_rows=cfg.heldout_rows, prompt_min_tokens=cfg.prompt_min_tokens,
            prompt_max_tokens=cfg.prompt_tokens, max_new_tokens=cfg.max_new_tokens, seed=cfg.seed,
            backend=backend))
    return make_workload(target_dir, out_dir, rows=cfg.rows, heldout=cfg.heldout_rows,
                         prompt_tokens=cfg.prompt_tokens, max_new_tokens=cfg.max_new_tokens, seed=cfg.seed,
                         backend=backend, prompt_spread=cfg.prompt_spread,
                         chat_template_kwargs=cfg.chat_template_kwargs)
