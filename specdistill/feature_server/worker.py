"""The feature worker process: build the target backend, prefill the rows handed to it, publish the samples.

One spawned process per worker (specdistill/feature_server/server.py starts and supervises them). It loads the target once
and reports "ready", then takes (stream id, rows) tasks from its pipe, stream after stream (epochs, held-out sets),
until the stop sentinel (None). It hands the backend as many of the rows it holds as fit `batch_tokens` per call
(one batched prefill; a longer row goes alone), publishing each row's sample through its ShmProducer with the
stream id (`backend.publish`: the vLLM engine writes it into the ring in place, others copy it in), and "done" at
the end; an exception is reported as "error" with the rows it was working on. A reader thread drains the pipe
into a local queue as tasks arrive: the server may send more task bytes than a pipe buffers while the engine is
busy, and it must never block on a worker that is itself waiting for ring space. Tasks come through a plain pipe,
not a multiprocessing Queue: a Queue's locks are named POSIX semaphores (/dev/shm/sem.mp-*), which a kill -9 of
the run would leave behind. It dies with the trainer (PR_SET_PDEATHSIG) and runs in its own process group, so whatever it
starts (a vLLM engine) can be killed with it.
"""

import ctypes
import faulthandler
import os
import queue
import signal
import sys
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass

import torch

from specdistill.core.contract import FeatureSpec
from specdistill.core.process_exit import exit_now
from specdistill.core.progress_lock import thread_lock_for_progress_bars
from specdistill.core.vllm_engine import engine_in_this_process
from specdistill.feature_server.backends import build_backend
from specdistill.feature_server.shm_transport import ShmProducer, sweep_segments


@dataclass(frozen=True)
class WorkerArgs:
    """What one worker process starts with (pickled across the spawn)."""

    worker: int  # producer id: unique per process, a replacement gets a new one
    backend: str
    target_dir: str
    spec: FeatureSpec
    device: str
    dtype: str | None
    threads: int
    batch_tokens: int  # tokens per backend call (whole rows; a longer row goes alone)
    max_row_tokens: int | None  # the longest row the streams carry (None: the target's context)
    engine_in_worker: bool  # vLLM: the engine in this process, not in processes of its own (config.py)
    parent_pid: int  # the trainer process: the worker exits when it dies
    tasks: object  # read end of a pipe: (stream id, row tuple) tasks; None = stop


class _Terminated(BaseException):
    """SIGTERM (from close(), or the trainer's death) as an exception, so the worker exits through its
    finalizers (a partial segment is unlinked, tqdm's named semaphore released) instead of vanishing."""


def _on_sigterm(signum, frame):
    raise _Terminated


def worker_main(args: WorkerArgs, channel: ShmProducer) -> None:
    # Its own process group, inherited by the vLLM engine processes it starts: if this worker is killed, the
    # trainer kills the group (server.py's _kill_group), so no engine is left behind holding memory or a GPU.
    os.setpgid(0, 0)
    signal.signal(signal.SIGTERM, _on_sigterm)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the trainer stops us
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID` prints where a worker is stuck
    _die_with_parent(args.parent_pid, channel.prefix)
    os.umask(0o077)  # whatever the backend writes is private to this user
    torch.set_num_threads(args.threads)
    thread_lock_for_progress_bars()  # a kill -9 of this worker leaves nothing in /dev/shm
    if args.engine_in_worker:  # this process is the worker's alone
        engine_in_this_process()
    batch, backend = [], None
    try:
        t0 = time.perf_counter()
        device = _pin_gpu(args.device)
        backend = build_backend(args.backend, args.target_dir, args.spec, device=device, dtype=args.dtype,
                                batch_tokens=args.batch_tokens, max_row_tokens=args.max_row_tokens)
        channel.send("ready", info={"num_hidden_layers": backend.num_hidden_layers,
                                                   "hidden_size": backend.hidden_size,
                                                   "load_s": time.perf_counter() - t0})
        tasks = _TaskReader(args.tasks)
        while (work := tasks.next_batch(args.batch_tokens)) is not None:
            stream, batch = work
            backend.publish(batch, channel, {"stream": stream})
            batch = []
        channel.send("done", info={"blocked_s": channel.blocked_seconds})
    except _Terminated:
        channel.abandon()  # the trainer is shutting down: report nothing, wait for nothing
        # SIGTERM comes from the trainer's close() (which sweeps too, after joining us) or from the trainer's
        # death (PR_SET_PDEATHSIG; getppid() may still name it at this instant): either way the channel is done,
        # and after a kill -9 of the trainer nobody else is left to remove our files.
        sweep_segments(channel.prefix)
        sys.exit(128 + signal.SIGTERM)
    except BaseException as e:
        channel.send("error", key=batch[0].row_id if batch else None,
                     info={"rows": [r.row_id for r in batch], "error": f"{type(e).__name__}: {e}"[:2000],
                           "traceback": traceback.format_exc()})
        channel.close()
        sys.exit(1)
    finally:
        if backend is not None:
            backend.close()
    channel.close()  # flush the control queue before the process exits
    exit_now(0)  # the trainer joins us now: no interpreter teardown (docs/launching.md, "Process start-up")


class _TaskReader:
    """Drains the task pipe on a thread; hands out batches of the rows received so far."""

    def __init__(self, conn):
        self._conn, self._inbox = conn, queue.Queue()
        self._held: deque = deque()  # (stream id, row), in arrival order
        self._stopped = False
        threading.Thread(target=self._read, name="task-reader", daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                task = self._conn.recv()
            except (EOFError, OSError):  # the server's end is gone: stop
                task = None
            self._inbox.put(task)
            if task is None:
                return

    def _take(self, block: bool) -> None:
        try:
            task = self._inbox.get(block=block)
        except queue.Empty:
            return
        if task is None:
            self._stopped = True
        else:
            stream, rows = task
            self._held.extend((stream, row) for row in rows)

    def next_batch(self, batch_tokens: int):
        """(stream id, rows): the oldest held rows of one stream that fit batch_tokens (at least one row); None once
        the stop sentinel came and every held row was handed out."""
        while not self._held and not self._stopped:
            self._take(block=True)
        while not self._inbox.empty():  # everything already received joins the batch
            self._take(block=False)
        if not self._held:
            return None
        stream, batch, tokens = self._held[0][0], [], 0
        while self._held and self._held[0][0] == stream and (not batch or
                                                             tokens + self._held[0][1].num_tokens <= batch_tokens):
            row = self._held.popleft()[1]
            batch.append(row)
            tokens += row.num_tokens
        return stream, batch


def _pin_gpu(device: str) -> str:
    """"cuda:N" -> this process sees only GPU N (as cuda:0), so a vLLM engine started here cannot touch the others."""
    if not device.startswith("cuda:"):
        return device
    index = int(device.split(":")[1])
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = visible.split(",")[index] if visible else str(index)
    return "cuda:0"


def _die_with_parent(parent_pid: int, prefix: str) -> None:
    """Linux: SIGTERM this worker when the trainer dies, so a kill -9'd trainer leaves no orphans behind."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return  # not Linux: close() and atexit still stop workers
    if os.getppid() != parent_pid:  # the trainer died before prctl took effect
        sweep_segments(prefix)
        os._exit(1)
