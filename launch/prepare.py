"""Resolve what a run trains on: the target checkpoint dir and the train/held-out JSONL files.

Tiny targets and synthetic workloads are built once into the cache and reused (keyed by the target's
fingerprint and the workload settings), so re-runs and resumes never regenerate them.
"""

import hashlib
import json
from pathlib import Path

from launch.config import DataConfig, TargetConfig
from launch.targets import ensure_target
from launch.make_workload import make_workload


def resolve_target(cfg: TargetConfig, cache_dir: Path) -> Path:
    if cfg.path:
        path = Path(cfg.path).expanduser()
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"target.path={cfg.path}: no config.json there; expected a local HF checkpoint dir")
        return path
    if not cfg.name:
        raise ValueError("set target=NAME (a tiny target) or target.path=DIR (a local HF checkpoint)")
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
    if cfg.source != "synthetic":
        raise ValueError(f"data.source={cfg.source!r}; valid: synthetic, jsonl")
    key = json.dumps([target_fingerprint(target_dir), cfg.rows, cfg.heldout_rows, cfg.prompt_tokens,
                      cfg.max_new_tokens, cfg.seed])
    out_dir = cache_dir / "workloads" / hashlib.sha256(key.encode()).hexdigest()[:12]
    train, heldout = out_dir / "train.jsonl", out_dir / "heldout.jsonl"
    if train.is_file() and heldout.is_file():
        return train, heldout
    return make_workload(target_dir, out_dir, rows=cfg.rows, heldout=cfg.heldout_rows,
                         prompt_tokens=cfg.prompt_tokens, max_new_tokens=cfg.max_new_tokens, seed=cfg.seed)
