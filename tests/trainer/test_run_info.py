"""run_info.json's git SHA is the checkout's the code was loaded from, and none for an installed package: a wheel in
some other repository's venv must not record that repository's commit."""

import subprocess

import pytest

from specdistill.trainer.run_info import git_sha


def _git(cwd, *args):
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd, check=True,
                   capture_output=True)


@pytest.fixture
def repo(tmp_path):
    """A git repository with a committed file, like a user's project."""
    _git(tmp_path, "init", "-q")
    (tmp_path / "README").write_text("a project\n")
    _git(tmp_path, "add", "README")
    _git(tmp_path, "commit", "-q", "-m", "first")
    return tmp_path


def _package(parent):
    (parent / "specdistill").mkdir(parents=True)
    (parent / "specdistill" / "__init__.py").write_text('__version__ = "0"\n')
    return parent / "specdistill"


def test_a_package_installed_inside_another_repository_records_no_sha(repo):
    package = _package(repo / ".venv" / "lib" / "python3.11" / "site-packages")  # untracked: a venv's files
    assert git_sha(package) is None


def test_a_checkout_that_tracks_the_package_records_its_head(repo):
    package = _package(repo)
    _git(repo, "add", "specdistill/__init__.py")
    _git(repo, "commit", "-q", "-m", "the package")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True).stdout.strip()
    assert git_sha(package) == head
    (repo / "specdistill" / "__init__.py").write_text('__version__ = "1"\n')
    assert git_sha(package) == head + "-dirty"


def test_a_package_outside_any_repository_records_no_sha(tmp_path):
    assert git_sha(_package(tmp_path)) is None
