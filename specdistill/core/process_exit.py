"""Leaving a finished process without the interpreter's final teardown.

A process that has imported torch and transformers spends ~1 s of CPU at exit collecting their objects (the
interpreter's finalization), after its work is done and while whoever started it waits. `exit_now` does what a
normal exit does that matters, in the same order, and then leaves with os._exit: threading's exit hooks run and
non-daemon threads are joined (their work finishes; an executor's hook stops its idle workers, which a bare join would
wait for forever), the atexit handlers run (multiprocessing's finalizers unlink the named semaphores the process
made, logging flushes its files, a FeatureServer left open stops its workers), stdout and stderr are flushed.
"""

import atexit
import os
import sys
import threading
from typing import NoReturn


def exit_now(code: int = 0) -> NoReturn:
    threading._shutdown()  # CPython's own exit runs these two steps first; os._exit would skip them
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or broken: nothing left to save
            pass
    os._exit(code)
