"""FeatureServer: target workers extract hidden states for disjoint row shards; the trainer iterates samples.

Per trainer rank, `workers` spawned processes each build a backend (backends.py) and prefill their shard,
publishing FeatureSamples through a ShmChannel (tensors in /dev/shm, metadata on the control queue). Global shard
g = rank * workers + worker over num_ranks * workers shards, row i of `rows` belongs to shard i % num_shards
(before skipping), so torchrun ranks see disjoint data and a resumed run keeps the same assignment.

The trainer side checks every sample that crosses the boundary (shape, dtype, tokens, shard membership, exactly
once), re-raises a worker's exception with its worker id and row id, and turns a worker that died silently into
an error instead of a hang. Shutdown terminates workers and sweeps the segments.
"""

import atexit
import ctypes
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

from feature_server.backends import BACKENDS, build_backend
from feature_server.contract import FeatureSample, FeatureSpec, TokenizedRow
from feature_server.shm_transport import Received, ShmChannel

_POLL_S = 0.5  # how often the trainer re-checks worker liveness while waiting for a sample
_JOIN_S = 30.0  # grace for finished workers to exit before they are terminated


class FeatureWorkerError(RuntimeError):
    """A feature worker failed (exception, or died without a word)."""


def shard_rows(rows: Sequence[TokenizedRow], shard: int, num_shards: int) -> list[TokenizedRow]:
    """Round-robin by position: balanced, and independent of which rows a resumed run skips."""
    return list(rows[shard::num_shards])


@dataclass(frozen=True)
class _WorkerArgs:
    worker: int
    shard: int
    num_shards: int
    backend: str
    target_dir: str
    spec: FeatureSpec
    device: str
    dtype: str | None
    threads: int
    batch_rows: int
    rows: tuple[TokenizedRow, ...]
    parent_pid: int


class ShardLedger:
    """Trainer-side bookkeeping: which rows each worker still owes, and the checks on what arrives."""

    def __init__(self, spec: FeatureSpec, rows_by_worker: dict[int, list[TokenizedRow]]):
        self.spec = spec
        self.rows = {r.row_id: (w, r) for w, rows in rows_by_worker.items() for r in rows}
        self.pending = {w: deque(r.row_id for r in rows) for w, rows in rows_by_worker.items()}  # shard order
        self._pending_sets = {w: set(ids) for w, ids in self.pending.items()}
        self.hidden_size: int | None = None
        self.num_hidden_layers: int | None = None

    def ready(self, worker: int, info: dict) -> None:
        dims = (info["num_hidden_layers"], info["hidden_size"])
        if self.hidden_size is not None and dims != (self.num_hidden_layers, self.hidden_size):
            raise FeatureWorkerError(f"feature worker {worker}: target has (layers, hidden) = {dims}, other "
                                     f"workers reported {(self.num_hidden_layers, self.hidden_size)}")
        self.num_hidden_layers, self.hidden_size = dims

    def accept(self, msg: Received) -> FeatureSample:
        worker, row_id = msg.producer_id, msg.key
        if self.hidden_size is None:
            raise FeatureWorkerError(f"feature worker {worker}: row {row_id} arrived before the worker was ready")
        if row_id not in self._pending_sets.get(worker, ()):
            why = "was already received" if row_id in self.rows else "is not in this rank's rows"
            if row_id in self.rows and self.rows[row_id][0] != worker:
                why = f"belongs to worker {self.rows[row_id][0]}'s shard"
            raise FeatureWorkerError(f"feature worker {worker}: row {row_id} {why}")
        if set(msg.tensors) != {"input_ids_T", "loss_mask_T", "hidden_TLD"}:
            raise FeatureWorkerError(f"feature worker {worker}: row {row_id} carries fields {sorted(msg.tensors)}")
        sample = FeatureSample(row_id=row_id, **msg.tensors)
        sample.check(self.spec, self.hidden_size)
        if sample.loss_mask_T.dtype != torch.bool:  # FeatureSample.check leaves the mask dtype to us
            raise FeatureWorkerError(f"feature worker {worker}: row {row_id} loss mask is {sample.loss_mask_T.dtype}, "
                                     "expected torch.bool")
        row = self.rows[row_id][1]
        if not (torch.equal(sample.input_ids_T, torch.tensor(row.input_ids, dtype=torch.int64))
                and torch.equal(sample.loss_mask_T, torch.tensor(row.loss_mask, dtype=torch.bool))):
            raise FeatureWorkerError(f"feature worker {worker}: row {row_id} tokens or loss mask differ from "
                                     "the dataset row")
        self._pending_sets[worker].remove(row_id)
        self.pending[worker].remove(row_id)  # O(1): the head, since a worker publishes in shard order
        return sample

    def done(self, worker: int) -> None:
        if self.pending[worker]:
            missing = list(self.pending[worker])
            raise FeatureWorkerError(f"feature worker {worker} reported done, but rows {missing[:10]} "
                                     f"({len(missing)} in all) never arrived")


class FeatureServer:
    """Iterate FeatureSamples of this rank's rows (each exactly once, order not guaranteed).

    workers: target processes for this rank; device: one for all, or one per worker ("cuda:3").
    dtype: the target's compute dtype (None = the checkpoint's). batch_rows: rows per backend.extract call.
    capacity_mb: bytes in shared memory not yet taken by the trainer (backpressure bound).
    skip_row_ids: rows already trained on (resume); skipping never moves a row to another shard.
    shm_prefix: segment-name prefix; pass a stable one so a restart sweeps a crashed run's leftovers.

    Use as a context manager, or iterate to the end (or break out): workers are stopped, segments swept.
    Workers die with the thread that started them (PR_SET_PDEATHSIG), so start it from a long-lived thread.
    """

    def __init__(self, target_dir: str, spec: FeatureSpec, rows: Sequence[TokenizedRow], *, backend: str = "hf",
                 workers: int = 1, rank: int = 0, num_ranks: int = 1, capacity_mb: float = 256,
                 device: str | Sequence[str] = "cpu", dtype: str | None = None,
                 skip_row_ids: frozenset[int] = frozenset(), threads_per_worker: int = 1, batch_rows: int = 1,
                 shm_prefix: str | None = None):
        if backend not in BACKENDS:
            raise ValueError(f"unknown feature backend {backend!r}; valid names: {sorted(BACKENDS)}")
        if workers < 1 or num_ranks < 1 or not 0 <= rank < num_ranks:
            raise ValueError(f"need workers >= 1 and 0 <= rank < num_ranks, got workers={workers}, rank={rank}, "
                             f"num_ranks={num_ranks}")
        if batch_rows < 1 or threads_per_worker < 1 or capacity_mb <= 0:
            raise ValueError(f"batch_rows ({batch_rows}), threads_per_worker ({threads_per_worker}) and "
                             f"capacity_mb ({capacity_mb}) must be positive")
        devices = [device] * workers if isinstance(device, str) else list(device)
        if len(devices) != workers:
            raise ValueError(f"{len(devices)} devices given for {workers} workers (pass one device or one per worker)")
        _check_unique_ids(rows)
        num_shards = num_ranks * workers
        self.spec = spec
        self._capacity_bytes = max(1, int(capacity_mb * 2**20))
        self._shm_prefix = shm_prefix
        self._args = {}
        for w in range(workers):
            shard = rank * workers + w
            mine = tuple(r for r in shard_rows(rows, shard, num_shards) if r.row_id not in skip_row_ids)
            self._args[w] = _WorkerArgs(w, shard, num_shards, backend, str(target_dir), spec, devices[w], dtype,
                                        threads_per_worker, batch_rows, mine, os.getpid())
        self._ledger = ShardLedger(spec, {w: list(a.rows) for w, a in self._args.items()})
        self._procs: dict[int, mp.process.BaseProcess] = {}
        self._channel: ShmChannel | None = None
        self._done: set[int] = {w for w, a in self._args.items() if not a.rows}  # empty shards: no process
        self._silent_exits: set[int] = set()
        self._per_worker = {w: {"samples": 0, "extract_s": 0.0, "load_s": 0.0, "blocked_s": 0.0} for w in self._args}
        self._counts = {"samples": 0, "tokens": 0, "bytes": 0, "trainer_wait_s": 0.0}
        self._iterated = self._closed = False

    # ---- lifecycle -----------------------------------------------------------------------------------
    def start(self) -> None:
        if self._channel is not None:
            return
        ctx = mp.get_context("spawn")  # fork would copy the trainer's threads/CUDA state into the workers
        self._channel = ShmChannel(self._capacity_bytes, prefix=self._shm_prefix, ctx=ctx)
        _LIVE.add(self)
        try:
            for w, args in self._args.items():
                if w in self._done:
                    continue
                # Not daemonic: a vLLM backend spawns its own engine processes, which daemons may not do.
                p = ctx.Process(target=_worker_main, args=(args, self._channel), name=f"feature-worker-{w}")
                p.start()
                self._procs[w] = p
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Stop workers (finished ones get a grace period) and sweep this server's shared-memory segments."""
        if self._closed:
            return
        self._closed = True
        for w, p in self._procs.items():
            if w in self._done:
                p.join(_JOIN_S)
        for p in self._procs.values():
            if p.is_alive():
                p.terminate()
        for p in self._procs.values():
            p.join(_JOIN_S)
            if p.is_alive():
                p.kill()
                p.join()
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
        return sum(len(a.rows) for a in self._args.values())

    @property
    def hidden_size(self) -> int | None:
        """Known once a worker has loaded the target (None before)."""
        return self._ledger.hidden_size

    def worker_pids(self) -> dict[int, int]:
        return {w: p.pid for w, p in self._procs.items()}

    def __iter__(self) -> Iterator[FeatureSample]:
        if self._iterated:
            raise RuntimeError("a FeatureServer streams its rows once; build a new one to iterate again")
        self._iterated = True
        self.start()
        try:
            while len(self._done) < len(self._args):
                msg = self._next_message()
                if msg.kind == "data":
                    yield self._accept(msg)
                else:
                    self._on_control(msg)
        finally:
            self.close()

    def stats(self) -> dict:
        extract = [s["extract_s"] for s in self._per_worker.values()]
        return {**self._counts, "extract_wall_s_sum": sum(extract), "extract_wall_s_max": max(extract),
                "load_s_max": max(s["load_s"] for s in self._per_worker.values()),
                "backpressure_wait_s_sum": sum(s["blocked_s"] for s in self._per_worker.values()),
                "workers_done": len(self._done), "per_worker": {w: dict(s) for w, s in self._per_worker.items()}}

    def _next_message(self) -> Received:
        t0 = time.perf_counter()
        try:
            while True:
                try:
                    return self._channel.get(timeout=_POLL_S)
                except queue.Empty:
                    self._check_liveness()
        finally:
            self._counts["trainer_wait_s"] += time.perf_counter() - t0

    def _check_liveness(self) -> None:
        # A dead worker's last messages are in the pipe before its exit code is set; so raise only after a
        # second empty poll, which proves nothing more is coming from it.
        for w, p in self._procs.items():
            if w in self._done or p.exitcode is None:
                continue
            if w in self._silent_exits:
                pending = self._ledger.pending[w]
                at = (f"it was on row {pending[0]} or later, {len(pending)} rows undelivered" if pending
                      else "all rows delivered")
                raise FeatureWorkerError(
                    f"feature worker {w} (pid {p.pid}, shard {self._args[w].shard} of {self._args[w].num_shards}) "
                    f"exited with code {p.exitcode} without reporting an error (killed, or out of memory?); {at}")
            self._silent_exits.add(w)

    def _accept(self, msg: Received) -> FeatureSample:
        sample = self._ledger.accept(msg)
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
            self._ledger.ready(w, msg.info)
            self._per_worker[w]["load_s"] = msg.info["load_s"]
        elif msg.kind == "done":
            self._ledger.done(w)
            self._per_worker[w].update(extract_s=msg.info["extract_s"], blocked_s=msg.info["blocked_s"])
            self._done.add(w)
        elif msg.kind == "error":
            rows = msg.info["rows"]
            where = f"row {rows[0]}" if len(rows) == 1 else (f"rows {rows}" if rows else "before its first row")
            raise FeatureWorkerError(
                f"feature worker {w} (shard {self._args[w].shard} of {self._args[w].num_shards}) failed on {where}: "
                f"{msg.info['error']}\n--- worker traceback ---\n{msg.info['traceback']}")
        else:
            raise FeatureWorkerError(f"feature worker {w}: unknown control message kind {msg.kind!r}")


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


def _worker_main(args: _WorkerArgs, channel: ShmChannel) -> None:
    signal.signal(signal.SIGTERM, _on_sigterm)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the trainer stops us
    _die_with_parent(args.parent_pid)
    torch.set_num_threads(args.threads)
    w, batch, backend, extract_s = args.worker, [], None, 0.0
    try:
        t0 = time.perf_counter()
        backend = build_backend(args.backend, args.target_dir, args.spec, device=args.device, dtype=args.dtype)
        channel.send("ready", producer_id=w, info={"num_hidden_layers": backend.num_hidden_layers,
                                                   "hidden_size": backend.hidden_size,
                                                   "load_s": time.perf_counter() - t0})
        for start in range(0, len(args.rows), args.batch_rows):
            batch = args.rows[start: start + args.batch_rows]
            t0 = time.perf_counter()
            hiddens = backend.extract(list(batch))
            dt = time.perf_counter() - t0
            extract_s += dt
            if len(hiddens) != len(batch):
                raise RuntimeError(f"backend returned {len(hiddens)} hidden states for {len(batch)} rows")
            for row, hidden_TLD in zip(batch, hiddens):
                channel.put(row.row_id, _sample_tensors(row, hidden_TLD), producer_id=w,
                            info={"extract_s": dt / len(batch)})
        channel.send("done", producer_id=w, info={"extract_s": extract_s, "blocked_s": channel.blocked_seconds})
    except _Terminated:
        channel.abandon()  # the trainer is shutting down: report nothing, wait for nothing
        sys.exit(128 + signal.SIGTERM)
    except BaseException as e:
        channel.send("error", producer_id=w, key=batch[0].row_id if batch else None,
                     info={"rows": [r.row_id for r in batch], "error": f"{type(e).__name__}: {e}"[:2000],
                           "traceback": traceback.format_exc()})
        channel.close()
        sys.exit(1)
    finally:
        if backend is not None:
            backend.close()
    channel.close()  # flush the control queue before the process exits


def _sample_tensors(row: TokenizedRow, hidden_TLD: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"input_ids_T": torch.tensor(row.input_ids, dtype=torch.int64),
            "loss_mask_T": torch.tensor(row.loss_mask, dtype=torch.bool), "hidden_TLD": hidden_TLD}


def _die_with_parent(parent_pid: int) -> None:
    """Linux: SIGTERM this worker when the trainer dies, so a kill -9'd trainer leaves no orphans behind."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return  # not Linux: close() and atexit still stop workers
    if os.getppid() != parent_pid:  # the trainer died before prctl took effect
        os._exit(1)


_LIVE: "weakref.WeakSet[FeatureServer]" = weakref.WeakSet()


@atexit.register
def _close_live_servers() -> None:
    # Registered after multiprocessing's own exit hook, so it runs first: workers are stopped before
    # multiprocessing would join (and wait forever for) a worker blocked on backpressure.
    for server in list(_LIVE):
        server.close()
