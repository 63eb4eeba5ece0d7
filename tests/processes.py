"""Running a CLI command from a test with a deadline that explains a hang instead of hiding it.

pytest-timeout stops the test but kills only the direct child and loses its captured output. Here, at the deadline
(set below pytest's), every process of the command's tree gets SIGUSR1 first: specdistill.launch.train's ranks and the
feature workers register faulthandler on it, so each prints every thread's stack into the captured output. Then
the tree is stopped and the test fails with the output's tail.
"""

import signal
import subprocess
import threading
import time

import pytest


def run_bounded(cmd: list[str], *, cwd, env: dict, timeout_s: float = 780) -> subprocess.CompletedProcess:
    """`subprocess.run(cmd, capture_output=True, text=True)`, failing the test with the stacks of every process of
    the command's tree if it is still running after `timeout_s`."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out: dict[str, list[str]] = {"stdout": [], "stderr": []}
    readers = [threading.Thread(target=lambda s=s, name=name: out[name].extend(s), daemon=True)
               for name, s in (("stdout", proc.stdout), ("stderr", proc.stderr))]
    for r in readers:
        r.start()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        tree = _tree(proc.pid)
        _signal_all(tree, signal.SIGUSR1)
        time.sleep(3)  # the dumps are written from the signal handler, even by a thread stuck in C++
        _stop(proc, tree)
        for r in readers:
            r.join(timeout=10)
        output = "".join(out["stdout"])[-3000:] + "".join(out["stderr"])[-12000:]
        pytest.fail(f"still running after {timeout_s:.0f} s: {' '.join(cmd)[:300]}\n"
                    f"processes: {[(p.pid, ' '.join(p.cmdline())[:100]) for p in tree if p.is_running()]}\n"
                    f"output tail (with every thread's stack):\n{output}", pytrace=False)
    for r in readers:
        r.join(timeout=30)
    return subprocess.CompletedProcess(cmd, proc.returncode, "".join(out["stdout"]), "".join(out["stderr"]))


def _tree(pid: int) -> list:
    import psutil

    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def _signal_all(procs, sig) -> None:
    import psutil

    for p in procs:
        try:
            p.send_signal(sig)
        except psutil.Error:
            pass


def _stop(proc: subprocess.Popen, tree) -> None:
    import psutil

    proc.terminate()  # specdistill.launch.train passes SIGTERM on to its ranks, which stop their workers
    _, alive = psutil.wait_procs(tree, timeout=30)
    _signal_all(alive, signal.SIGKILL)
    proc.wait()
