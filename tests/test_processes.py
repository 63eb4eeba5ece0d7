"""tests/processes.py: a hung command fails its test with every thread's stack, and leaves no process behind."""

import sys

import psutil
import pytest

from tests.processes import run_bounded

HANGS = """
import faulthandler, signal, subprocess, sys, time
faulthandler.register(signal.SIGUSR1, all_threads=True)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print(child.pid, flush=True)
def stuck_here():
    time.sleep(600)
stuck_here()
"""


def test_a_hung_command_fails_with_its_stack_and_is_stopped():
    with pytest.raises(pytest.fail.Exception) as failure:
        run_bounded([sys.executable, "-c", HANGS], cwd=".", env={}, timeout_s=5)
    message = str(failure.value)
    assert "still running after 5 s" in message and "in stuck_here" in message
    child = int(message.split("output tail")[1].split("\n")[1].split()[0])  # the pid the command printed
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE


def test_a_finished_command_returns_its_output():
    proc = run_bounded([sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr)"],
                       cwd=".", env={}, timeout_s=60)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "out\n", "err\n")
