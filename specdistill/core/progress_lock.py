"""Progress bars without a named semaphore, for processes that may be killed.

tqdm's default write lock holds a multiprocessing RLock, which is a named POSIX semaphore in /dev/shm; transformers
and vLLM create a bar (weights loading) in every feature worker and engine host. A kill -9 of such a process leaves
that semaphore behind until the resource tracker of the process that started it exits: for a worker the trainer
started, the end of the run; for one a test started, the end of the test session. Each of these processes draws its
own bars (spawned, it shares no tqdm lock with its parent anyway), so a thread lock does the same job.
"""

import threading


def thread_lock_for_progress_bars() -> None:
    """Before any bar of this process exists: tqdm bars share a thread lock, not a multiprocessing one."""
    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())
