"""specdistill/core/process_exit.py: exit_now leaves as a normal exit would, without the interpreter's teardown."""

import subprocess
import sys
import textwrap

from tests.cli import REPO

# A process with unfinished work at exit: a non-daemon thread still writing, an atexit handler, and two executors
# left open (a thread pool and a process pool, as vllm_serve's engine host is one), then exit_now(3).
SCRIPT = textwrap.dedent("""
    import atexit, concurrent.futures, multiprocessing, sys, threading, time
    from specdistill.core.process_exit import exit_now

    def late_write():
        time.sleep(0.5)
        with open(sys.argv[1], "a") as f:
            f.write("thread\\n")

    if __name__ == "__main__":
        threading.Thread(target=late_write).start()
        atexit.register(lambda: open(sys.argv[1], "a").write("atexit\\n"))
        threads = concurrent.futures.ThreadPoolExecutor(1)
        processes = concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
        assert threads.submit(abs, -1).result() == processes.submit(abs, -2).result() - 1
        print("exiting", flush=True)
        exit_now(3)
""")


def test_exit_now_finishes_the_work_left_and_stops_open_executors(tmp_path):
    script, log = tmp_path / "script.py", tmp_path / "log"
    script.write_text(SCRIPT)
    proc = subprocess.run([sys.executable, str(script), str(log)], cwd=REPO, capture_output=True, text=True,
                          timeout=120)  # a join that waits for an open executor's idle worker would hang here
    assert proc.returncode == 3 and proc.stdout == "exiting\n", proc.stderr[-3000:]
    assert log.read_text() == "thread\natexit\n"  # the thread's write came first: joined before the atexit handlers
