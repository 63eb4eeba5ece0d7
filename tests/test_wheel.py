"""The package a user installs (`pip install specdistill`, `pip install .`): the sdist holds what the wheel is built
from, the wheel holds what the commands read (Hydra's configs, small-real and its corpus rows), and, installed away
from this checkout, every console script answers `--help` and `--version`, a user's own config directory composes
over the packaged configs, and `specdistill-train` trains small-real for 2 steps from another directory.

Nothing of the checkout can stand in for a missing file: the sdist is built from a copy of the files git would commit
(no build/ folder, no egg-info), the wheel from that sdist (as pip builds one), and it is installed into a venv of its
own. That venv reuses this environment's installed dependencies through one .pth line naming their site-packages
(nothing is downloaded), which puts them on the path without running that folder's own .pth files: the editable
install's finder, which would map `specdistill` back to the checkout, is one of them."""

import json
import os
import subprocess
import sys
import sysconfig
import tarfile
import tomllib
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from specdistill import __version__
from tests.cli import REPO, SMALL

pytestmark = pytest.mark.slow  # ~2 min: two builds, a venv, 17 command starts, 2 training steps

SCRIPTS = sorted(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"])


def _run(cmd: list, cwd: Path, timeout_s: float = 300, **env) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the checkout must not be on the path
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env={**clean, **env}, capture_output=True, text=True,
                          timeout=timeout_s)
    assert proc.returncode == 0, f"{cmd}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


def _committed_files() -> list[str]:
    """What a clone of this checkout holds once its changes are committed: tracked and untracked-not-ignored files."""
    try:
        out = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                             capture_output=True, text=True, timeout=60, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: nothing to build the sdist from but the sdist itself")
    return [f for f in out.split("\0") if f and (REPO / f).is_file()]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(sdist, wheel, the package files a clone holds) built from a clean copy of the checkout."""
    root = tmp_path_factory.mktemp("wheel")
    files = _committed_files()
    copy = root / "clone"
    for name in files:
        (copy / name).parent.mkdir(parents=True, exist_ok=True)
        (copy / name).write_bytes((REPO / name).read_bytes())
    dist = root / "dist"
    build_sdist = f"from setuptools import build_meta; print(build_meta.build_sdist({str(dist)!r}))"
    sdist = dist / _run([sys.executable, "-c", build_sdist], copy).stdout.split()[-1]
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index", "-w", dist,
          sdist], root)
    (wheel,) = dist.glob("*.whl")
    return sdist, wheel, sorted(f for f in files if f.startswith("specdistill/"))


@pytest.fixture(scope="module")
def venv(built, tmp_path_factory):
    """A venv holding only the wheel; this environment's site-packages on its path for the dependencies."""
    path = tmp_path_factory.mktemp("venv") / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", path], path.parent)
    python = path / "bin" / "python"
    site = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], path).stdout.strip())
    (site / "specdistill-dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run([sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", "--no-index", built[1]], path)
    return path


def test_the_sdist_and_the_wheel_hold_every_file_of_the_package(built):
    sdist, wheel, package_files = built
    with tarfile.open(sdist) as tar:
        in_sdist = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    in_wheel = set(zipfile.ZipFile(wheel).namelist())
    read_at_run_time = ["specdistill/conf/config.yaml", "specdistill/launch/assets/small-real/model.safetensors",
                        "specdistill/launch/assets/small-real-corpus/train.parquet"]
    assert all(f in package_files for f in read_at_run_time)
    assert not [f for f in package_files if f not in in_sdist], "missing from the sdist"
    assert not [f for f in package_files if f not in in_wheel], "missing from the wheel"


def test_every_installed_command_answers_help_and_version(venv, tmp_path):
    commands = [venv / "bin" / script for script in SCRIPTS]
    assert all(c.is_file() for c in commands), "a console script was not installed from the wheel"
    with ThreadPoolExecutor(2) as pool:  # 16 interpreter starts, two at a time
        helps = list(pool.map(lambda c: _run([c, "--help"], tmp_path).stdout, commands))
        versions = list(pool.map(lambda c: _run([c, "--version"], tmp_path).stdout.strip(), commands))
    for script, help_text, version in zip(SCRIPTS, helps, versions):
        # argparse's usage names the command; specdistill-train's help is Hydra's, listing the packaged groups
        expected = "== Configuration groups ==" if script == "specdistill-train" else script
        assert expected in help_text, f"{script} --help:\n{help_text[:1000]}"
        assert version == f"specdistill {__version__}", f"{script} --version: {version!r}"


def test_a_users_config_dir_composes_over_the_packaged_configs(venv, tmp_path):
    (tmp_path / "mine" / "target").mkdir(parents=True)
    (tmp_path / "mine" / "target" / "my-model.yaml").write_text("defaults:\n  - target_schema\n\npath: /models/mine\n")
    job = _run([venv / "bin" / "specdistill-train", "--config-dir", tmp_path / "mine", "target=my-model",
                "drafter=eagle3", "--cfg", "job"], tmp_path).stdout
    assert "path: /models/mine" in job and "name: eagle3" in job  # the user's group option beside the package's


def test_installed_train_runs_small_real_from_another_directory(venv, tmp_path):
    python, work = venv / "bin" / "python", tmp_path / "elsewhere"
    work.mkdir()
    where = "import specdistill.launch.assets as s; print(s.__file__); print(s.SMALL_REAL_CORPUS_DIR)"
    module, corpus = _run([python, "-c", where], work).stdout.split()
    assert Path(module).is_relative_to(venv), f"specdistill imported from {module}, not from the installed wheel"
    rows = Path(corpus) / "heldout.parquet"  # the packaged corpus rows, as the wheel installed them
    run_dir = work / "run"
    small = [o for o in SMALL if not o.startswith(("drafter", "data."))]
    _run([venv / "bin" / "specdistill-train", "drafter=eagle3", "target=small-real", "data=jsonl",
          f"data.train_path={rows}", f"data.heldout_path={rows}", "trainer.max_steps=2", "trainer.eval_rows=4",
          *small, f"hydra.run.dir={run_dir}"], work, timeout_s=600, SPECDISTILL_CACHE=str(work / "cache"))
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["steps"] == 2 and (run_dir / "export" / "model.safetensors").is_file()
    info = json.loads((run_dir / "run_info.json").read_text())
    assert info["specdistill_version"] == __version__
    assert info["git_sha"] is None  # the code ran from a wheel, not from a checkout
