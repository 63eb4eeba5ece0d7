"""The feature worker process: build the target backend, prefill the rows handed to it, publish the samples.

One spawned process per worker (feature_server/server.py starts and supervises them). It loads the target once
and reports "ready", then takes (stream id, rows) tasks from its pipe, stream after stream (epochs, held-out sets),
until the stop sentinel (None), publishing each row's sample through its ShmProducer with the stream id
(`backend.publish`: the vLLM engine writes it into the ring in place, others copy it in), and "done"
at the end; an exception is reported as "error" with the rows it was working on. Tasks come through a plain pipe,
not a multiprocessing Queue: a Queue's locks are named POSIX semaphores (/dev/shm/sem.mp-*), which a kill -9 of
the run would leave behind. It dies with the trainer (PR_SET_PDEATHSIG) and runs in its own process group, so whatever it
starts (a vLLM engine) can be killed with it.
"""

import ctypes
import faulthandler
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass

import torch

from core.contract import FeatureSpec
from feature_server.backends import build_backend
from feature_server.shm_transport import ShmProducer, sweep_segments


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
    batch_rows: int
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
    w, batch, backend = args.worker, [], None
    try:
        t0 = time.perf_counter()
        device = _pin_gpu(args.device)
        backend = build_backend(args.backend, args.target_dir, args.spec, device=device, dtype=args.dtype)
        channel.send("ready", info={"num_hidden_layers": backend.num_hidden_layers,
                                                   "hidden_size": backend.hidden_size,
                                                   "load_s": time.perf_counter() - t0})
        while (task := _next_task(args.tasks)) is not None:
            stream, rows = task
            for start in range(0, len(rows), args.batch_rows):
                batch = rows[start: start + args.batch_rows]
                backend.publish(list(batch), channel, {"stream": stream})
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


def _next_task(tasks):
    """The next (stream id, rows) task; None to stop, also when the server's end of the pipe is gone."""
    try:
        return tasks.recv()
    except EOFError:
        return None


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
