"""Every console script answers --version with the package's version (specdistill-train's before Hydra's parser,
whose --version prints Hydra's) and takes --verbose; the installed commands: tests/test_wheel.py."""

import os
import sys

import pytest

from specdistill import __version__
from specdistill.core.quiet import VERBOSE_ENV
from specdistill.launch.command import own_flags


def test_train_answers_the_package_version_not_hydras(monkeypatch, capsys):
    from specdistill.launch.train import cli

    monkeypatch.setattr(sys, "argv", ["specdistill-train", "drafter=eagle3", "--version"])
    with pytest.raises(SystemExit) as stop:
        cli()
    assert stop.value.code == 0 and capsys.readouterr().out.strip() == f"specdistill {__version__}"


def test_verbose_is_taken_out_of_the_overrides_and_reaches_child_processes(monkeypatch):
    monkeypatch.setenv(VERBOSE_ENV, "0")  # restored after the test
    assert own_flags(["drafter=eagle3", "--verbose", "trainer.max_steps=2"], "") == ["drafter=eagle3",
                                                                                       "trainer.max_steps=2"]
    assert os.environ[VERBOSE_ENV] == "1"


def test_eval_answers_the_package_version(capsys):
    from specdistill.launch.evaluate import main

    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.strip() == f"specdistill {__version__}"


def test_processes_spawned_under_the_train_command_do_not_import_the_trainer(tmp_path):
    """multiprocessing's spawn re-imports the launching module in every child (feature workers, vLLM's engine
    processes): specdistill.launch.train keeps the trainer, transformers and the launchers out of its own imports."""
    loaded = _modules_after(tmp_path, "import runpy, sys; sys.argv = ['specdistill-train']; "
                                      "runpy.run_module('specdistill.launch.train', run_name='__mp_main__')",
                            ('transformers', 'vllm', 'specdistill.trainer.trainer', 'specdistill.launch.prepare',
                             'specdistill.launch.ranks'))
    assert loaded == []


def test_the_train_commands_own_imports_leave_out_transformers_models(tmp_path):
    """What main() imports (data preparation, the trainer, the rank launcher) needs transformers' configs and
    tokenizers only: its models cost a process ~3 s of CPU (docs/launching.md, "Process start-up")."""
    loaded = _modules_after(tmp_path, "import specdistill.launch.train, specdistill.launch.prepare, "
                                      "specdistill.trainer.trainer, specdistill.launch.ranks, "
                                      "specdistill.data.token_store, specdistill.trainer.run_info",
                            ('transformers.modeling_utils', 'vllm'))
    assert loaded == []


def _modules_after(cwd, code: str, names: tuple[str, ...]) -> list[str]:
    """Which of `names` a fresh interpreter has in sys.modules after running `code`."""
    import ast
    import subprocess

    probe = f"import sys; {code}; print(sorted(m for m in {names!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=cwd, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return ast.literal_eval(out.stdout.strip().splitlines()[-1])
