"""Leaving a finished process without the interpreter's final teardown.

A process that has imported torch and transformers spends ~1 s of CPU at exit collecting their objects (the
interpreter's finalization), after its work is done and while whoever started it waits. `exit_now` does what a
normal exit does that matters, in the same order, and then leaves with os._exit: non-daemon threads are joined
(their work finishes), the atexit handlers run (multiprocessing's finalizers unlink the named semaphores the process
made, logging flushes its files, a FeatureServer left open stops its workers), stdout and stderr are flushed.
"""

import atexit
import os
import sys
import threading
from typing import NoReturn


def exit_now(code: int = 0) -> NoReturn:
    current = threading.current_thread()
    for thread in threading.enumerate():
        if thread is not current and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()  # CPython's own exit runs these; os._exit would skip them
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or broken: nothing left to save
            pass
    os._exit(code)
