"""FeatureServer: target workers extract hidden states for this rank's rows; the trainer iterates samples.

The supervisor of the worker processes. Per trainer rank, `workers` spawned processes (worker.py) each build a
backend (backends.py) and prefill the rows they are handed, publishing FeatureSamples through a ShmChannel
(tensors in /dev/shm, metadata on the control queue). Row i of `rows` belongs to rank i % num_ranks (before
skipping; ledger.py shard_rows), so torchrun ranks see disjoint data and a resumed run keeps the same assignment.
Within a rank, rows are handed out dynamically, round-robin, until each worker holds `2 * batch_tokens` tokens
(one prefill batch in the engine, the next one waiting), so a slow worker does not hold the others back; a worker
hands the engine as many of its rows per call as fit `feature_server.batch_tokens` (worker.py).

One server per run: the workers load the target once, then take stream after stream (`stream(rows)`: each epoch
of training rows, the held-out rows) without restarting; an engine load of a large target happens once per worker
and run, not per epoch. Iterating the server itself is the one-stream form: its `rows`, then the workers stop.

Exactly once: the SampleLedger (ledger.py) knows every row as pending, in flight (handed to one worker) or done.
A worker that dies (kill -9, OOM) has its in-flight rows put back at the front of the queue for the others, and a
replacement is started while `max_worker_restarts` allows; a late copy of a row that is already done is dropped
and counted, never yielded twice. The trainer side checks every sample that crosses the boundary (shape, dtype,
tokens, membership), and re-raises a worker's exception with its worker id and row id (a row that makes the
backend raise is a data error, not a fault to retry).
"""

import atexit
import logging
import os
import queue
import signal
import time
import weakref
from collections.abc import Iterator, Sequence

import multiprocessing as mp
import numpy as np

from specdistill.core.contract import FeatureSample, FeatureSpec, TokenizedRow
from specdistill.core.rows import Rows, as_rows, check_unique_ids
from specdistill.feature_server.backends import BACKENDS
from specdistill.feature_server.config import FeatureServerConfig
from specdistill.feature_server.ledger import FeatureWorkerError, SampleLedger, shard_rows
from specdistill.feature_server.shm_transport import MAX_PRODUCERS, Received, ShmChannel
from specdistill.feature_server.worker import WorkerArgs, worker_main

log = logging.getLogger(__name__)

_POLL_S = 0.5  # how often the trainer re-checks worker liveness (and cancel()) while waiting for a sample
_JOIN_S = 30.0  # grace for finished workers to exit before they are terminated


class StreamCancelled(Exception):
    """cancel() was called while a stream waited for a sample."""


class FeatureServer:
    """Iterate FeatureSamples of this rank's rows (each exactly once, order not guaranteed).

    config: backend, target dtype, threads, shared-memory capacity (split over the workers; backpressure) and
        the stall/load timeouts, as the run's `feature_server` settings give them (specdistill/feature_server/config.py).
    devices: one per worker of this server ("cuda:3"); None = config.workers workers on config.device. A
        trainer rank passes its own workers' devices (specdistill/trainer/layout.py), so config.workers stays per node.
    max_row_tokens: the longest row a stream will carry (the run's pack size): bounds the engine's context
        (a vLLM engine sizes its cache and batch for it); None = the target's own context.
    skip_row_ids: rows already trained on (resume); skipping never moves a row to another rank.
    shm_prefix: file-name prefix; pass a stable one so a restart sweeps a crashed run's leftovers.
    max_worker_restarts: replacements started for workers that die, before the server gives up.
    A worker silent for config.stall_timeout_s while the trainer waits (owing rows; config.load_timeout_s while
    still loading the target) is killed as hung, and treated as one that died.

    rows: what iterating the server streams (one pass, then the workers stop); None for a server fed through
        `stream()`, whose workers (one per device) live until close().

    Use as a context manager, or iterate to the end (or break out): workers are stopped, segments swept.
    Workers die with the thread that started them (PR_SET_PDEATHSIG), so start it from a long-lived thread.
    """

    def __init__(self, target_dir: str, spec: FeatureSpec, rows: "Rows | Sequence[TokenizedRow] | None",
                 config: FeatureServerConfig,
                 *, devices: Sequence[str] | None = None, rank: int = 0, num_ranks: int = 1,
                 skip_row_ids: frozenset[int] = frozenset(), max_row_tokens: int | None = None,
                 shm_prefix: str | None = None, max_worker_restarts: int = 3):
        c = config
        if c.backend not in BACKENDS:
            raise ValueError(f"feature_server.backend={c.backend!r}; valid names: {sorted(BACKENDS)}")
        devices = [c.device] * c.workers if devices is None else list(devices)
        if not devices or num_ranks < 1 or not 0 <= rank < num_ranks:
            raise ValueError(f"need >= 1 worker and 0 <= rank < num_ranks, got {len(devices)} workers, rank={rank}, "
                             f"num_ranks={num_ranks}")
        if c.batch_tokens < 1 or c.threads_per_worker < 1 or c.capacity_mb <= 0 or max_worker_restarts < 0:
            raise ValueError(f"feature_server.batch_tokens ({c.batch_tokens}), feature_server.threads_per_worker "
                             f"({c.threads_per_worker}) and feature_server.capacity_mb ({c.capacity_mb}) must be "
                             f"positive and max_worker_restarts ({max_worker_restarts}) >= 0")
        if c.stall_timeout_s <= 0 or c.load_timeout_s <= 0:
            raise ValueError(f"feature_server.stall_timeout_s ({c.stall_timeout_s}) and load_timeout_s "
                             f"({c.load_timeout_s}) must be positive")
        if len(devices) + max_worker_restarts > MAX_PRODUCERS:
            raise ValueError(f"workers + max_worker_restarts must be <= {MAX_PRODUCERS}")
        self.spec, self.rank, self.num_ranks = spec, rank, num_ranks
        self._one_shot = rows is not None
        self.rows = self._mine(rows if rows is not None else (), skip_row_ids, sharded=True)
        self._capacity_bytes = max(1, int(c.capacity_mb * 2**20))
        self._shm_prefix = shm_prefix
        self._config, self._target_dir, self._max_row_tokens = c, str(target_dir), max_row_tokens
        self._parent_pid = os.getpid()  # the workers' parent: they exit when it dies
        self._devices = devices
        self._prefetch_tokens = 2 * c.batch_tokens
        self._restarts_left = max_worker_restarts
        self._ledger = SampleLedger(spec, self.rows, stream=0)
        self._streams = 0  # streams started; the current one's id
        self._streaming = False
        self._past = {"rows_reissued": 0, "duplicates_dropped": 0}  # of finished streams' ledgers
        self._dims: dict | None = None  # (layers, hidden) the first worker reported; checked for every other
        self._loads: dict[int, int] = {}  # worker slot -> target (engine) loads
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
        self._closed = False
        self._cancelled = False

    # ---- lifecycle -----------------------------------------------------------------------------------
    def start(self) -> None:
        if self._channel is not None:
            return
        # One-shot: no more workers than rows (none for none); a run's server: one per device, for every stream.
        slots = min(len(self._devices), max(1, len(self.rows))) if self._one_shot else len(self._devices)
        self._channel = ShmChannel(self._capacity_bytes, prefix=self._shm_prefix, ctx=self._ctx, producers=slots)
        _LIVE.add(self)
        try:
            if self.rows or not self._one_shot:
                for slot in range(slots):
                    self._spawn(slot)
        except BaseException:
            self.close()
            raise

    def _spawn(self, slot: int) -> int:
        w, self._next_id = self._next_id, self._next_id + 1
        task_reader, tasks = self._ctx.Pipe(duplex=False)  # a pipe: no named semaphores (worker.py)
        c = self._config
        args = WorkerArgs(worker=w, backend=c.backend, target_dir=self._target_dir, spec=self.spec,
                          device=self._devices[slot], dtype=c.dtype, threads=c.threads_per_worker,
                          batch_tokens=c.batch_tokens, max_row_tokens=self._max_row_tokens,
                          engine_in_worker=c.engine_in_worker, parent_pid=self._parent_pid, tasks=task_reader)
        # Not daemonic: a vLLM backend spawns its own engine processes, which daemons may not do.
        p = self._ctx.Process(target=worker_main, args=(args, self._channel.producer(w)), name=f"feature-worker-{w}")
        p.start()
        task_reader.close()  # the worker holds the read end now
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
        if not self._one_shot and self._channel is not None and not self._streaming:
            self._stop_workers()  # between streams: let them report done and exit
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

    def cancel(self) -> None:
        """From another thread: a stream waiting for a sample raises StreamCancelled at its next poll (the
        thread that iterates it then closes the server)."""
        self._cancelled = True

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
        """The one-stream form: this server's `rows` once, then the workers stop and the segments are swept."""
        if not self._one_shot or self._streams:
            raise RuntimeError("a FeatureServer built with rows streams them once; build it with rows=None and call "
                               "stream(rows) for several passes")
        try:
            yield from self._stream(self.rows)
            self._stop_workers()
        finally:
            self.close()

    def stream(self, rows: "Rows | Sequence[TokenizedRow]", skip_row_ids: frozenset[int] = frozenset(),
               sharded: bool = True) -> Iterator[FeatureSample]:
        """One pass over `rows` (an epoch, a held-out set): this rank's share (all of them with sharded=False),
        minus skip_row_ids, each exactly once; the workers stay up for the next stream. One stream at a time."""
        if self._one_shot:
            raise RuntimeError("stream() is for servers built with rows=None; iterate this one")
        return self._stream(self._mine(rows, skip_row_ids, sharded))

    def select(self, rows: "Rows | Sequence[TokenizedRow]", skip_row_ids: frozenset[int] = frozenset()) -> Rows:
        """This rank's share of `rows` minus skip_row_ids, in order: what `stream(rows, skip_row_ids)` streams."""
        return self._mine(rows, skip_row_ids, sharded=True)

    def _mine(self, rows, skip_row_ids, sharded: bool) -> Rows:
        rows = as_rows(rows)
        check_unique_ids(rows)
        mine = shard_rows(rows, self.rank, self.num_ranks) if sharded else rows
        if not skip_row_ids:
            return mine
        skip = np.fromiter(skip_row_ids, dtype=np.int64, count=len(skip_row_ids))
        return mine.take(np.flatnonzero(~np.isin(mine.row_ids, skip)))

    def _stream(self, rows: Rows) -> Iterator[FeatureSample]:
        if self._streaming:
            raise RuntimeError("a stream of this FeatureServer is still open; finish or close it first")
        self._begin_stream(rows)
        self._streaming = True
        try:
            self.start()
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
        finally:
            self._streaming = False

    def _begin_stream(self, rows: Rows) -> None:
        if not self._one_shot:  # a new ledger per stream; the finished one's counts are kept
            self._past["rows_reissued"] += self._ledger.reissued
            self._past["duplicates_dropped"] += self._ledger.duplicates_dropped
            self._ledger = SampleLedger(self.spec, rows, stream=self._streams)
            if self._dims is not None:
                self._ledger.ready(-1, self._dims)
        self._streams += 1

    def stats(self) -> dict:
        per = self._per_worker.values()
        extract = [s["extract_s"] for s in per] or [0.0]
        return {**self._counts, "extract_wall_s_sum": sum(extract), "extract_wall_s_max": max(extract),
                "load_s_max": max([s["load_s"] for s in per] or [0.0]),
                "backpressure_wait_s_sum": sum(s["blocked_s"] for s in per),
                "workers_done": len(self._finished), "workers_died": len(self._died),
                "workers_stalled": len(self._stalled),
                "rows_reissued": self._past["rows_reissued"] + self._ledger.reissued,
                "duplicates_dropped": self._past["duplicates_dropped"] + self._ledger.duplicates_dropped,
                "rows_lost": len(self._ledger.rows) - self._ledger.num_done,  # of the current (or last) stream
                "streams": self._streams, "engine_loads": sum(self._loads.values()),
                "engine_loads_per_slot": dict(self._loads),
                "per_worker": {w: dict(s) for w, s in self._per_worker.items()}}

    def _dispatch(self) -> None:
        """Top every live worker up to `2 * batch_tokens` tokens in flight, one row at a time round-robin (a worker
        with nothing in flight gets at least one row, however long)."""
        tasks: dict[int, list[TokenizedRow]] = {}
        hungry = [w for w in sorted(self._live - self._stopping)
                  if self._ledger.outstanding_tokens(w) < self._prefetch_tokens]
        while hungry and self._ledger.has_pending:
            for w in list(hungry):
                if not self._ledger.has_pending:
                    break
                if not self._ledger.outstanding(w):  # idle until now: its silence counts from here
                    self._heard[w] = time.monotonic()
                tasks.setdefault(w, []).extend(self._ledger.assign(w, 1))
                if self._ledger.outstanding_tokens(w) >= self._prefetch_tokens:
                    hungry.remove(w)
        for w, rows in tasks.items():
            self._send_task(w, (self._ledger.stream, tuple(rows)))

    def _send_task(self, w: int, task) -> None:
        try:
            self._tasks[w].send(task)
        except (BrokenPipeError, ConnectionResetError, OSError):
            pass  # it died: its rows are reissued when the liveness checks see its exit (_worker_died)

    def _stop_workers(self) -> None:
        """Every row is done: send the stop sentinel and collect the workers' final stats."""
        for w in self._live:
            self._send_task(w, None)
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
                    if self._cancelled:
                        raise StreamCancelled()
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
            limit = self._config.stall_timeout_s if loaded else self._config.load_timeout_s
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
        if w in self._stopping or (self._one_shot and self._ledger.complete):  # nothing more is owed
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
                                     f"{len(self._ledger.rows) - self._ledger.num_done} rows not done")
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
            self._dims = {k: msg.info[k] for k in ("num_hidden_layers", "hidden_size")}
            slot = self._slot[w]
            self._loads[slot] = self._loads.get(slot, 0) + 1
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


_LIVE: "weakref.WeakSet[FeatureServer]" = weakref.WeakSet()


@atexit.register
def _close_live_servers() -> None:
    # Registered after multiprocessing's own exit hook, so it runs first: workers are stopped before
    # multiprocessing would join (and wait forever for) a worker blocked on backpressure.
    for server in list(_LIVE):
        server.close()
