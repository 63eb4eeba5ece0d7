"""FeatureServer: target workers extract hidden states for this rank's rows; the trainer iterates samples.

Per trainer rank, `workers` spawned processes each build a backend (backends.py) and prefill the rows they are
handed, publishing FeatureSamples through a ShmChannel (tensors in /dev/shm, metadata on the control queue).
Row i of `rows` belongs to rank i % num_ranks (before skipping), so torchrun ranks see disjoint data and a
resumed run keeps the same assignment. Within a rank, rows are handed out dynamically, a few at a time per
worker, so a slow worker does not hold the others back.

Exactly once: the SampleLedger knows every row as pending, in flight (handed to one worker) or done. A worker
that dies (kill -9, OOM) has its in-flight rows put back at the front of the queue for the others, and a
replacement is started while `max_worker_restarts` allows; a late copy of a row that is already done is
dropped and counted, never yielded twice. The trainer side checks every sample that crosses the boundary
(shape, dtype, tokens, membership), and re-raises a worker's exception with its worker id and row id (a row
that makes the backend raise is a data error, not a fault to retry).
"""

import atexit
import ctypes
import faulthandler
import logging
import os
import queue
import signal
import sys
import time
import traceback
import weakref
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import multiprocessing as mp
import torch

from core.contract import FeatureSample, FeatureSpec, TokenizedRow
from feature_server.backends import BACKENDS, build_backend
from feature_server.config import FeatureServerConfig
from feature_server.shm_transport import MAX_PRODUCERS, Received, ShmChannel, ShmProducer, sweep_segments

log = logging.getLogger(__name__)

_POLL_S = 0.5  # how often the trainer re-checks worker liveness while waiting for a sample
_JOIN_S = 30.0  # grace for finished workers to exit before they are terminated


class FeatureWorkerError(RuntimeError):
    """A feature worker failed (exception, or died without a word and could not be replaced)."""


def shard_rows(rows: Sequence[TokenizedRow], shard: int, num_shards: int) -> list[TokenizedRow]:
    """Round-robin by position: balanced, and independent of which rows a resumed run skips."""
    return list(rows[shard::num_shards])


@dataclass(frozen=True)
class _WorkerArgs:
    worker: int  # producer id: unique per process, a replacement gets a new one
    backend: str
    target_dir: str
    spec: FeatureSpec
    device: str
    dtype: str | None
    threads: int
    batch_rows: int
    parent_pid: int
    tasks: object  # multiprocessing Queue of row tuples; None = stop


class SampleLedger:
    """Trainer-side bookkeeping: every row of this rank is pending, in flight (with one worker) or done."""

    def __init__(self, spec: FeatureSpec, rows: Sequence[TokenizedRow]):
        self.spec = spec
        self.rows = {r.row_id: r for r in rows}
        self.pending = deque(r.row_id for r in rows)  # dataset order; reissued rows go to the front
        self.in_flight: dict[int, dict[int, None]] = {}  # worker -> row ids, in hand-out order
        self.owner: dict[int, int] = {}  # row id -> worker holding it
        self.done: set[int] = set()
        self.reissued = 0
        self.duplicates_dropped = 0
        self.hidden_size: int | None = None
        self.num_hidden_layers: int | None = None

    @property
    def complete(self) -> bool:
        return len(self.done) == len(self.rows)

    def outstanding(self, worker: int) -> int:
        return len(self.in_flight.get(worker, ()))

    def ready(self, worker: int, info: dict) -> None:
        dims = (info["num_hidden_layers"], info["hidden_size"])
        if self.hidden_size is not None and dims != (self.num_hidden_layers, self.hidden_size):
            raise FeatureWorkerError(f"feature worker {worker}: target has (layers, hidden) = {dims}, other "
                                     f"workers reported {(self.num_hidden_layers, self.hidden_size)}")
        self.num_hidden_layers, self.hidden_size = dims

    def assign(self, worker: int, n: int) -> list[TokenizedRow]:
        out = []
        while self.pending and len(out) < n:
            row_id = self.pending.popleft()
            self.in_flight.setdefault(worker, {})[row_id] = None
            self.owner[row_id] = worker
            out.append(self.rows[row_id])
        return out

    def accept(self, msg: Received) -> FeatureSample | None:
        """The checked sample, or None for a late duplicate of a row already done (counted)."""
        worker, row_id = msg.producer_id, msg.key
        if self.hidden_size is None:
            raise FeatureWorkerError(f"feature worker {worker}: row {row_id} arrived before any worker was ready")
        if row_id not in self.rows:
            raise FeatureWorkerError(f"feature worker {worker}: row {row_id} is not in this rank's rows")
        if row_id in self.done:
            self.duplicates_dropped += 1
            return None
        if set(msg.tensors) != {"input_ids_T", "loss_mask_T", "hidden_TLD"}:
            raise FeatureWorkerError(f"feature worker {worker}: row {row_id} carries fields {sorted(msg.tensors)}")
        sample = FeatureSample(row_id=row_id, **msg.tensors)
        sample.check(self.spec, self.hidden_size)
        if sample.loss_mask_T.dtype != torch.bool:  # FeatureSample.check leaves the mask dtype to us
            raise FeatureWorkerError(f"feature worker {worker}: row {row_id} loss mask is {sample.loss_mask_T.dtype}, "
                                     "expected torch.bool")
        row = self.rows[row_id]
        if not (torch.equal(sample.input_ids_T, torch.tensor(row.input_ids, dtype=torch.int64))
                and torch.equal(sample.loss_mask_T, torch.tensor(row.loss_mask, dtype=torch.bool))):
            raise FeatureWorkerError(f"feature worker {worker}: row {row_id} tokens or loss mask differ from "
                                     "the dataset row")
        holder = self.owner.pop(row_id, None)
        if holder is not None:
            del self.in_flight[holder][row_id]
        else:  # reissued after its worker was declared dead, then its first copy arrived after all
            self.pending.remove(row_id)
        self.done.add(row_id)
        return sample

    def worker_died(self, worker: int) -> list[int]:
        """Put a dead worker's in-flight rows back at the front of the queue; returns them."""
        ids = list(self.in_flight.pop(worker, {}))
        for row_id in ids:
            del self.owner[row_id]
        self.pending.extendleft(reversed(ids))
        self.reissued += len(ids)
        return ids

    def finished(self, worker: int) -> None:
        if self.outstanding(worker):
            missing = list(self.in_flight[worker])
            raise FeatureWorkerError(f"feature worker {worker} reported done, but rows {missing[:10]} "
                                     f"({len(missing)} in all) never arrived")


class FeatureServer:
    """Iterate FeatureSamples of this rank's rows (each exactly once, order not guaranteed).

    config: backend, target dtype, threads, shared-memory capacity (split over the workers; backpressure) and
        the stall/load timeouts, as the run's `feature_server` settings give them (feature_server/config.py).
    devices: one per worker of this server ("cuda:3"); None = config.workers workers on config.device. A
        trainer rank passes its own workers' devices (trainer/layout.py), so config.workers stays per node.
    batch_rows: rows per backend.extract call; each worker holds at most 2 * batch_rows rows at a time (what a
        death puts back in the queue).
    skip_row_ids: rows already trained on (resume); skipping never moves a row to another rank.
    shm_prefix: file-name prefix; pass a stable one so a restart sweeps a crashed run's leftovers.
    max_worker_restarts: replacements started for workers that die, before the server gives up.
    A worker silent for config.stall_timeout_s while the trainer waits (owing rows; config.load_timeout_s while
    still loading the target) is killed as hung, and treated as one that died.

    Use as a context manager, or iterate to the end (or break out): workers are stopped, segments swept.
    Workers die with the thread that started them (PR_SET_PDEATHSIG), so start it from a long-lived thread.
    """

    def __init__(self, target_dir: str, spec: FeatureSpec, rows: Sequence[TokenizedRow], config: FeatureServerConfig,
                 *, devices: Sequence[str] | None = None, rank: int = 0, num_ranks: int = 1,
                 skip_row_ids: frozenset[int] = frozenset(), batch_rows: int = 1, shm_prefix: str | None = None,
                 max_worker_restarts: int = 3):
        c = config
        if c.backend not in BACKENDS:
            raise ValueError(f"feature_server.backend={c.backend!r}; valid names: {sorted(BACKENDS)}")
        devices = [c.device] * c.workers if devices is None else list(devices)
        if not devices or num_ranks < 1 or not 0 <= rank < num_ranks:
            raise ValueError(f"need >= 1 worker and 0 <= rank < num_ranks, got {len(devices)} workers, rank={rank}, "
                             f"num_ranks={num_ranks}")
        if batch_rows < 1 or c.threads_per_worker < 1 or c.capacity_mb <= 0 or max_worker_restarts < 0:
            raise ValueError(f"batch_rows ({batch_rows}), feature_server.threads_per_worker ({c.threads_per_worker}) "
                             f"and feature_server.capacity_mb ({c.capacity_mb}) must be positive and "
                             f"max_worker_restarts ({max_worker_restarts}) >= 0")
        if c.stall_timeout_s <= 0 or c.load_timeout_s <= 0:
            raise ValueError(f"feature_server.stall_timeout_s ({c.stall_timeout_s}) and load_timeout_s "
                             f"({c.load_timeout_s}) must be positive")
        if len(devices) + max_worker_restarts > MAX_PRODUCERS:
            raise ValueError(f"workers + max_worker_restarts must be <= {MAX_PRODUCERS}")
        _check_unique_ids(rows)
        self.spec = spec
        self.rows = [r for r in shard_rows(rows, rank, num_ranks) if r.row_id not in skip_row_ids]
        self._capacity_bytes = max(1, int(c.capacity_mb * 2**20))
        self._shm_prefix = shm_prefix
        self._config = dict(backend=c.backend, target_dir=str(target_dir), spec=spec, dtype=c.dtype,
                            threads=c.threads_per_worker, batch_rows=batch_rows, parent_pid=os.getpid())
        self._devices = devices
        self._prefetch = 2 * batch_rows
        self._restarts_left = max_worker_restarts
        self._stall_timeout_s, self._load_timeout_s = c.stall_timeout_s, c.load_timeout_s
        self._ledger = SampleLedger(spec, self.rows)
        self._ctx = mp.get_context("spawn")  # fork would copy the trainer's threads/CUDA state into the workers
        self._procs: dict[int, mp.process.BaseProcess] = {}  # producer id -> process (live and dead)
        self._tasks: dict[int, object] = {}
        self._slot: dict[int, int] = {}  # producer id -> worker slot (its device)
        self._live: set[int] = set()
        self._stopping: set[int] = set()  # sent the stop sentinel
        self._suspect: set[int] = set()  # exited; declared dead after one more empty poll
        self._finished: set[int] = set()  # reported done
        self._died: set[int] = set()
        self._loaded: set[int] = set()  # reported ready
        self._stalled: set[int] = set()  # killed by the stall watchdog (also in _died)
        self._heard: dict[int, float] = {}  # producer id -> monotonic time of its last message, start, or new work
        self._channel: ShmChannel | None = None
        self._per_worker: dict[int, dict] = {}
        self._counts = {"samples": 0, "tokens": 0, "bytes": 0, "trainer_wait_s": 0.0}
        self._next_id = 0
        self._iterated = self._closed = False

    # ---- lifecycle -----------------------------------------------------------------------------------
    def start(self) -> None:
        if self._channel is not None:
            return
        slots = min(len(self._devices), max(1, len(self.rows)))
        self._channel = ShmChannel(self._capacity_bytes, prefix=self._shm_prefix, ctx=self._ctx, producers=slots)
        _LIVE.add(self)
        try:
            if self.rows:
                for slot in range(slots):
                    self._spawn(slot)
        except BaseException:
            self.close()
            raise

    def _spawn(self, slot: int) -> int:
        w, self._next_id = self._next_id, self._next_id + 1
        tasks = self._ctx.Queue()
        args = _WorkerArgs(worker=w, device=self._devices[slot], tasks=tasks, **self._config)
        # Not daemonic: a vLLM backend spawns its own engine processes, which daemons may not do.
        p = self._ctx.Process(target=_worker_main, args=(args, self._channel.producer(w)), name=f"feature-worker-{w}")
        p.start()
        self._channel.started(w)
        self._procs[w], self._tasks[w], self._slot[w] = p, tasks, slot
        self._live.add(w)
        self._heard[w] = time.monotonic()
        self._per_worker[w] = {"samples": 0, "extract_s": 0.0, "load_s": 0.0, "blocked_s": 0.0, "slot": slot}
        return w

    def close(self) -> None:
        """Stop workers (finished ones get a grace period) and sweep this server's shared-memory files."""
        if self._closed:
            return
        self._closed = True
        for w, p in self._procs.items():
            if w in self._stopping:
                p.join(_JOIN_S)
        for p in self._procs.values():
            if p.is_alive():
                p.terminate()
        for p in self._procs.values():
            p.join(_JOIN_S)
            if p.is_alive():
                p.kill()
                p.join()
            _kill_group(p.pid)  # whatever the worker started and did not stop (an engine after a kill -9)
        if self._channel is not None:
            self._channel.close()
        _LIVE.discard(self)

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- trainer side --------------------------------------------------------------------------------
    @property
    def num_rows(self) -> int:
        """Rows this rank will receive (after skip_row_ids)."""
        return len(self.rows)

    @property
    def hidden_size(self) -> int | None:
        """Known once a worker has loaded the target (None before)."""
        return self._ledger.hidden_size

    def worker_pids(self) -> dict[int, int]:
        """Live workers: producer id -> pid."""
        return {w: self._procs[w].pid for w in sorted(self._live)}

    def __iter__(self) -> Iterator[FeatureSample]:
        if self._iterated:
            raise RuntimeError("a FeatureServer streams its rows once; build a new one to iterate again")
        self._iterated = True
        self.start()
        try:
            self._dispatch()
            while not self._ledger.complete:
                msg = self._next_message()
                if msg.kind == "data":
                    sample = self._accept(msg)
                    self._dispatch()  # top the worker up before the trainer takes its time
                    if sample is not None:
                        yield sample
                else:
                    self._on_control(msg)
            self._stop_workers()
        finally:
            self.close()

    def stats(self) -> dict:
        per = self._per_worker.values()
        extract = [s["extract_s"] for s in per] or [0.0]
        return {**self._counts, "extract_wall_s_sum": sum(extract), "extract_wall_s_max": max(extract),
                "load_s_max": max([s["load_s"] for s in per] or [0.0]),
                "backpressure_wait_s_sum": sum(s["blocked_s"] for s in per),
                "workers_done": len(self._finished), "workers_died": len(self._died),
                "workers_stalled": len(self._stalled),
                "rows_reissued": self._ledger.reissued, "duplicates_dropped": self._ledger.duplicates_dropped,
                "rows_lost": len(self._ledger.rows) - len(self._ledger.done),
                "per_worker": {w: dict(s) for w, s in self._per_worker.items()}}

    def _dispatch(self) -> None:
        for w in sorted(self._live - self._stopping):
            want = self._prefetch - self._ledger.outstanding(w)
            if want > 0 and self._ledger.pending:
                if not self._ledger.outstanding(w):  # idle until now: its silence counts from here
                    self._heard[w] = time.monotonic()
                self._tasks[w].put(tuple(self._ledger.assign(w, want)))

    def _stop_workers(self) -> None:
        """Every row is done: send the stop sentinel and collect the workers' final stats."""
        for w in self._live:
            self._tasks[w].put(None)
            self._stopping.add(w)
        deadline = time.monotonic() + _JOIN_S
        while self._live and time.monotonic() < deadline:
            try:
                msg = self._channel.get(timeout=_POLL_S)
            except queue.Empty:
                self._live = {w for w in self._live if self._procs[w].exitcode is None}
                continue
            if msg.kind == "data":
                self._accept(msg)  # a late duplicate: counted and dropped
            else:
                self._on_control(msg)

    def _next_message(self) -> Received:
        t0 = time.perf_counter()
        waiting_since = time.monotonic()
        try:
            while True:
                try:
                    msg = self._channel.get(timeout=_POLL_S)
                except queue.Empty:
                    self._check_liveness()
                    self._check_stalls(waiting_since)
                    continue
                self._heard[msg.producer_id] = time.monotonic()
                return msg
        finally:
            self._counts["trainer_wait_s"] += time.perf_counter() - t0

    def _check_liveness(self) -> None:
        # Normally a death shows as end-of-stream on the worker's pipe (_on_control "eof"). This catches the
        # case where a child of the worker (a vLLM engine) still holds the pipe open: act on the exit code,
        # after a second empty poll, which proves nothing more is coming from it.
        for w in sorted(self._live):
            if self._procs[w].exitcode is None:
                continue
            if w in self._suspect:
                self._worker_died(w)
            self._suspect.add(w)

    def _check_stalls(self, waiting_since: float) -> None:
        # Silence only counts while the trainer waits: then it has drained every ring, so no worker can be
        # blocked on backpressure, and one that owes rows (or has not loaded yet) and sends nothing is hung.
        now = time.monotonic()
        for w in sorted(self._live - self._stopping):
            loaded = w in self._loaded
            if loaded and not self._ledger.outstanding(w):
                continue  # idle: nothing owed
            limit = self._stall_timeout_s if loaded else self._load_timeout_s
            silent_s = now - max(self._heard[w], waiting_since)
            if silent_s > limit:
                self._stalled.add(w)
                self._procs[w].kill()  # _worker_died kills its process group (an engine it started) too
                doing = f"{self._ledger.outstanding(w)} rows in flight" if loaded else "loading the target"
                knob = "stall_timeout_s" if loaded else "load_timeout_s"
                self._worker_died(w, f"feature worker {w} (pid {self._procs[w].pid}) sent nothing for "
                                     f"{silent_s:.0f} s while the trainer waited ({doing}; feature_server.{knob}="
                                     f"{limit:g}), so it was killed as hung")
                # Its death frees what it held and hands its rows on: the others' silence counts from now.
                for other in self._live:
                    self._heard[other] = time.monotonic()
                return

    def _worker_died(self, w: int, why: str | None = None) -> None:
        p = self._procs[w]
        p.join(_POLL_S)  # end-of-stream can come a moment before the exit code
        _kill_group(p.pid)
        self._live.discard(w)
        self._died.add(w)
        reissued = self._ledger.worker_died(w)
        self._channel.release_producer(w)
        why = why or (f"feature worker {w} (pid {p.pid}) exited with code {p.exitcode} without reporting an error "
                      f"(killed, or out of memory?)")
        what = f"{why}; {len(reissued)} in-flight rows reissued"
        if self._ledger.complete:  # died while being stopped: nothing is owed
            log.warning("%s after every row was delivered", what)
        elif self._restarts_left > 0:
            self._restarts_left -= 1
            new = self._spawn(self._slot[w])
            log.warning("%s; started worker %d in its place (%d restarts left)", what, new, self._restarts_left)
        elif self._live:
            log.warning("%s to the %d remaining workers", what, len(self._live))
        else:
            at = f"rows {reissued[:10]} undelivered" if reissued else "no row was in flight"
            raise FeatureWorkerError(f"{what}; no workers left and no restarts left; {at}, "
                                     f"{len(self._ledger.rows) - len(self._ledger.done)} rows not done")
        self._dispatch()

    def _accept(self, msg: Received) -> FeatureSample | None:
        sample = self._ledger.accept(msg)
        if sample is None:
            log.warning("feature worker %d: row %s arrived twice; the second copy was dropped", msg.producer_id,
                        msg.key)
            return None
        stats = self._per_worker[msg.producer_id]
        stats["samples"] += 1
        stats["extract_s"] += msg.info.get("extract_s", 0.0)
        self._counts["samples"] += 1
        self._counts["tokens"] += sample.input_ids_T.shape[0]
        self._counts["bytes"] += msg.nbytes
        return sample

    def _on_control(self, msg: Received) -> None:
        w = msg.producer_id
        if msg.kind == "ready":
            self._loaded.add(w)
            self._ledger.ready(w, msg.info)
            self._per_worker[w]["load_s"] = msg.info["load_s"]
        elif msg.kind == "done":
            self._ledger.finished(w)
            self._per_worker[w].update(blocked_s=msg.info["blocked_s"])
            self._live.discard(w)
            self._finished.add(w)
        elif msg.kind == "eof":
            if w in self._live:  # closed its pipe without "done": it died
                self._worker_died(w)
        elif msg.kind == "error":
            rows = msg.info["rows"]
            where = f"row {rows[0]}" if len(rows) == 1 else (f"rows {rows}" if rows else "before its first row")
            raise FeatureWorkerError(
                f"feature worker {w} failed on {where}: {msg.info['error']}\n"
                f"--- worker traceback ---\n{msg.info['traceback']}")
        else:
            raise FeatureWorkerError(f"feature worker {w}: unknown control message kind {msg.kind!r}")


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # the group is empty: nothing was left behind


def _check_unique_ids(rows: Sequence[TokenizedRow]) -> None:
    seen = set()
    for r in rows:
        if r.row_id in seen:
            raise ValueError(f"row id {r.row_id} appears twice in rows; row ids must be unique")
        seen.add(r.row_id)


# ---- worker process ------------------------------------------------------------------------------------
class _Terminated(BaseException):
    """SIGTERM (from close(), or the trainer's death) as an exception, so the worker exits through its
    finalizers (a partial segment is unlinked, tqdm's named semaphore released) instead of vanishing."""


def _on_sigterm(signum, frame):
    raise _Terminated


def _worker_main(args: _WorkerArgs, channel: ShmProducer) -> None:
    # Its own process group, inherited by the vLLM engine processes it starts: if this worker is killed, the
    # trainer kills the group (_kill_group), so no engine is left behind holding memory or a GPU.
    os.setpgid(0, 0)
    signal.signal(signal.SIGTERM, _on_sigterm)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the trainer stops us
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID` prints where a worker is stuck
    _die_with_parent(args.parent_pid, channel.prefix)
    os.umask(0o077)  # whatever the backend writes (vLLM's hand-off files) is private to this user
    os.environ["SPECDISTILL_SHM_PREFIX"] = channel.prefix  # scratch dirs named so the channel's sweep finds them
    torch.set_num_threads(args.threads)
    w, batch, backend = args.worker, [], None
    try:
        t0 = time.perf_counter()
        device = _pin_gpu(args.device)
        backend = build_backend(args.backend, args.target_dir, args.spec, device=device, dtype=args.dtype)
        channel.send("ready", info={"num_hidden_layers": backend.num_hidden_layers,
                                                   "hidden_size": backend.hidden_size,
                                                   "load_s": time.perf_counter() - t0})
        while (task := args.tasks.get()) is not None:
            for start in range(0, len(task), args.batch_rows):
                batch = task[start: start + args.batch_rows]
                t0 = time.perf_counter()
                hiddens = backend.extract(list(batch))
                dt = time.perf_counter() - t0
                if len(hiddens) != len(batch):
                    raise RuntimeError(f"backend returned {len(hiddens)} hidden states for {len(batch)} rows")
                for row, hidden_TLD in zip(batch, hiddens):
                    channel.put(row.row_id, _sample_tensors(row, hidden_TLD), info={"extract_s": dt / len(batch)})
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


def _pin_gpu(device: str) -> str:
    """"cuda:N" -> this process sees only GPU N (as cuda:0), so a vLLM engine started here cannot touch the others."""
    if not device.startswith("cuda:"):
        return device
    index = int(device.split(":")[1])
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = visible.split(",")[index] if visible else str(index)
    return "cuda:0"


def _sample_tensors(row: TokenizedRow, hidden_TLD: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"input_ids_T": torch.tensor(row.input_ids, dtype=torch.int64),
            "loss_mask_T": torch.tensor(row.loss_mask, dtype=torch.bool), "hidden_TLD": hidden_TLD}


def _die_with_parent(parent_pid: int, prefix: str) -> None:
    """Linux: SIGTERM this worker when the trainer dies, so a kill -9'd trainer leaves no orphans behind."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return  # not Linux: close() and atexit still stop workers
    if os.getppid() != parent_pid:  # the trainer died before prctl took effect
        sweep_segments(prefix)
        os._exit(1)


_LIVE: "weakref.WeakSet[FeatureServer]" = weakref.WeakSet()


@atexit.register
def _close_live_servers() -> None:
    # Registered after multiprocessing's own exit hook, so it runs first: workers are stopped before
    # multiprocessing would join (and wait forever for) a worker blocked on backpressure.
    for server in list(_LIVE):
        server.close()
