"""A bounded channel for tensor payloads between processes, through POSIX shared memory.

Design (why each choice):
- Data path: one raw file per payload under /dev/shm (tmpfs, i.e. RAM; never regular disk), written and read
  through mmap. Not `multiprocessing.shared_memory`: on Python 3.11 its resource_tracker unlinks a producer's
  segments when the producer exits, even if the consumer has not read them yet.
- Control path: one multiprocessing Queue carrying metadata only (kind, producer id, key = row id, segment name,
  per-field name/dtype/shape/offset/nbytes, small scalar info). `put` refuses anything else, so a tensor can
  never be pickled through the queue by accident.
- Capacity: bytes in flight (written, not yet consumed) are counted in shared memory under a lock.
  A producer blocks while in_flight + new > capacity, unless nothing is in flight (so one oversized payload
  still moves instead of deadlocking).
- Consumer: `get` copies the tensors out into ordinary (process-private) tensors, unlinks the segment and
  releases its capacity at once. Copy-out costs one memcpy, but it decouples capacity from how long the trainer
  keeps a sample (a packing buffer holding views would otherwise stall producers, or deadlock them).
- Cleanup: every segment name is `<prefix>-<producer>-<pid>-<seq>`, with a per-run prefix. The owning
  (consumer) channel sweeps `<prefix>-*` at start (leftovers of a crashed run with the same prefix), at close,
  at interpreter exit and on SIGTERM/SIGINT; so a producer killed mid-write (kill -9) leaves nothing behind
  once the consumer closes.

Legend: P = payload bytes of one segment.
"""

import atexit
import contextlib
import glob
import math
import mmap
import os
import re
import signal
import threading
import time
import uuid
import weakref
from dataclasses import dataclass, field
from multiprocessing.context import BaseContext

import multiprocessing as mp
import torch

SHM_DIR = "/dev/shm"
_ALIGN = 64  # field offsets are cache-line aligned so the copies stay vectorised
_PREFIX_RE = re.compile(r"^[A-Za-z0-9_.]+$")  # no '-': '<prefix>-*' must never match another run's prefix
_DTYPES = {
    str(dt).removeprefix("torch."): dt
    for dt in (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32,
               torch.int16, torch.int8, torch.uint8, torch.bool)
}
_SCALARS = (str, int, float, bool, type(None))
_POLL_S = 0.01  # a blocked producer re-checks capacity at least this often
_LOCK_TIMEOUT_S = 30.0


class ChannelFull(Exception):
    """A non-blocking (or timed-out) put found no capacity."""


@dataclass
class Received:
    """One control message from a producer; `tensors` is filled for kind == "data" only."""

    kind: str
    producer_id: int
    key: int | None
    info: dict
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    nbytes: int = 0


def check_metadata_only(obj, where: str = "message") -> None:
    """Raise TypeError unless obj is built from str/int/float/bool/None and tuples/lists/dicts of them."""
    if isinstance(obj, _SCALARS):
        return
    if isinstance(obj, (tuple, list)):
        for i, item in enumerate(obj):
            check_metadata_only(item, f"{where}[{i}]")
        return
    if isinstance(obj, dict):
        for k, v in obj.items():
            if not isinstance(k, str):
                raise TypeError(f"{where}: control-path keys must be str, got {type(k).__name__}")
            check_metadata_only(v, f"{where}.{k}")
        return
    raise TypeError(
        f"{where}: {type(obj).__name__} is not allowed on the control path (metadata only: "
        "str/int/float/bool/None, tuples/lists/dicts); tensors go through the shared-memory data path"
    )


def segment_paths(prefix: str) -> list[str]:
    """The /dev/shm files currently named with this channel prefix."""
    return sorted(glob.glob(os.path.join(SHM_DIR, f"{prefix}-*")))


def sweep_segments(prefix: str) -> int:
    """Unlink every segment of this prefix; returns how many were removed."""
    removed = 0
    for path in segment_paths(prefix):
        try:
            os.unlink(path)
            removed += 1
        except FileNotFoundError:  # consumed concurrently
            pass
    return removed


def _layout(tensors: dict[str, torch.Tensor]) -> tuple[list[dict], int]:
    fields, offset = [], 0
    for name, t in tensors.items():
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype not in _DTYPES:
            raise TypeError(f"field {name!r}: dtype {t.dtype} not supported, expected one of {sorted(_DTYPES)}")
        nbytes = t.numel() * t.element_size()
        fields.append({"name": name, "dtype": dtype, "shape": tuple(t.shape), "offset": offset, "nbytes": nbytes})
        offset += math.ceil(nbytes / _ALIGN) * _ALIGN
    return fields, max(offset, _ALIGN)  # tmpfs cannot mmap an empty file


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """Flat uint8 view of a CPU tensor (bf16 and bool included: only the element size matters)."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def _write_segment(path: str, tensors: dict[str, torch.Tensor], fields: list[dict], size_P: int) -> None:
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, size_P)
        with mmap.mmap(fd, size_P) as mm:
            dst_P = torch.frombuffer(mm, dtype=torch.uint8)
            for f in fields:
                if f["nbytes"]:
                    dst_P[f["offset"]: f["offset"] + f["nbytes"]].copy_(_as_bytes(tensors[f["name"]]))
            del dst_P  # release the buffer export before the mmap closes
    finally:
        os.close(fd)


def _read_segment(path: str, fields: list[dict]) -> dict[str, torch.Tensor]:
    fd = os.open(path, os.O_RDONLY)
    try:
        size_P = os.fstat(fd).st_size
        # ACCESS_COPY: a private mapping is writable, which torch.frombuffer wants; pages are never written.
        mm = mmap.mmap(fd, size_P, access=mmap.ACCESS_COPY)
    finally:
        os.close(fd)
    with mm:
        src_P = torch.frombuffer(mm, dtype=torch.uint8)
        out = {}
        for f in fields:
            t = torch.empty(tuple(f["shape"]), dtype=_DTYPES[f["dtype"]])
            if f["nbytes"]:
                t.reshape(-1).view(torch.uint8).copy_(src_P[f["offset"]: f["offset"] + f["nbytes"]])
            out[f["name"]] = t
        del src_P
    return out


class ShmChannel:
    """Many producers -> one consumer. Create it in the consumer (the owner), hand it to producer processes as
    a Process argument, `put` there and `get` here. The owner sweeps the segments; see the module doc."""

    def __init__(self, capacity_bytes: int, *, prefix: str | None = None, ctx: BaseContext | None = None,
                 handle_signals: bool = True):
        if not os.path.isdir(SHM_DIR):
            raise RuntimeError(f"{SHM_DIR} is missing: the transport needs POSIX shared memory (tmpfs)")
        self.prefix = prefix or f"sdshm_{os.getpid()}_{uuid.uuid4().hex[:8]}"
        if not _PREFIX_RE.match(self.prefix):
            raise ValueError(f"channel prefix {self.prefix!r} must match {_PREFIX_RE.pattern} (no '-' or '/')")
        if capacity_bytes < 1:
            raise ValueError(f"capacity_bytes must be >= 1, got {capacity_bytes}")
        ctx = ctx or mp.get_context("spawn")
        self.capacity_bytes = int(capacity_bytes)
        self._control = ctx.Queue()
        # Not a multiprocessing.Condition: its notify waits for every sleeper to wake, so a producer killed
        # while blocked would hang the consumer. A lock + wake-up semaphore + short poll cannot hang.
        self._lock = ctx.Lock()
        self._freed = ctx.Semaphore(0)
        self._in_flight = ctx.RawValue("q", 0)  # guarded by _lock
        self._blocked = ctx.RawValue("i", 0)  # producers waiting for capacity, guarded by _lock
        self._owner = True
        self._closed = False
        self._seq = 0
        self.blocked_seconds = 0.0  # this producer's time spent waiting for capacity
        sweep_segments(self.prefix)  # a crashed earlier run with the same prefix
        _OWNERS.add(self)
        if handle_signals:
            _install_signal_handlers()

    # Producers get a copy through Process args; only the owner sweeps and handles signals.
    def __getstate__(self):
        state = self.__dict__.copy()
        state.update(_owner=False, _seq=0, blocked_seconds=0.0)
        return state

    # ---- producer side -------------------------------------------------------------------------------
    def put(self, key: int, tensors: dict[str, torch.Tensor], *, producer_id: int = 0, info: dict | None = None,
            block: bool = True, timeout: float | None = None) -> None:
        """Publish one payload. Blocks for capacity (backpressure); ChannelFull if not block / timed out."""
        info = info or {}
        fields, size_P = _layout(tensors)
        msg = {"kind": "data", "producer": producer_id, "key": key, "info": info, "fields": fields,
               "nbytes": size_P, "segment": f"{self.prefix}-{producer_id}-{os.getpid()}-{self._seq}"}
        check_metadata_only(msg, f"row {key} control message")
        self._reserve(size_P, block, timeout)
        path = os.path.join(SHM_DIR, msg["segment"])
        try:
            _write_segment(path, tensors, fields, size_P)
            self._control.put(msg)
        except BaseException:
            _unlink_quietly(path)
            self._release(size_P)
            raise
        self._seq += 1

    def send(self, kind: str, *, producer_id: int = 0, key: int | None = None, info: dict | None = None) -> None:
        """A metadata-only message (ready / done / error...) on the same ordered control path."""
        if kind == "data":
            raise ValueError("kind 'data' is reserved for put()")
        msg = {"kind": kind, "producer": producer_id, "key": key, "info": info or {}}
        check_metadata_only(msg, f"{kind} control message")
        self._control.put(msg)

    def _reserve(self, size_P: int, block: bool, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        t0, waiting = time.monotonic(), False
        try:
            while True:
                with self._locked():
                    in_flight = self._in_flight.value
                    if in_flight == 0 or in_flight + size_P <= self.capacity_bytes:
                        self._in_flight.value = in_flight + size_P
                        return
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if not block or (remaining is not None and remaining <= 0):
                        raise ChannelFull(f"{in_flight} bytes in flight + {size_P} > capacity {self.capacity_bytes}")
                    if not waiting:
                        self._blocked.value += 1
                        waiting = True
                # Woken by the consumer's release; the poll bounds the wait if a wake-up went to another producer.
                self._freed.acquire(timeout=_POLL_S if remaining is None else min(_POLL_S, remaining))
        finally:
            if waiting:
                with self._locked():
                    self._blocked.value -= 1
                self.blocked_seconds += time.monotonic() - t0

    def _release(self, size_P: int) -> None:
        with self._locked():
            self._in_flight.value -= size_P
            waiters = self._blocked.value
        for _ in range(waiters):
            self._freed.release()

    @contextlib.contextmanager
    def _locked(self):
        # Held for a few arithmetic ops only; a timeout turns "a producer was killed holding it" into an error.
        if not self._lock.acquire(timeout=_LOCK_TIMEOUT_S):
            raise RuntimeError(f"channel {self.prefix}: capacity lock not acquired in {_LOCK_TIMEOUT_S} s "
                               "(a producer probably died while holding it)")
        try:
            yield
        finally:
            self._lock.release()

    # ---- consumer side -------------------------------------------------------------------------------
    def get(self, timeout: float | None = None) -> Received:
        """Next message in arrival order; raises queue.Empty after timeout. Data is copied out, its segment
        unlinked and its capacity released before this returns."""
        msg = self._control.get(timeout=timeout)
        if msg["kind"] != "data":
            return Received(msg["kind"], msg["producer"], msg["key"], msg["info"])
        path = os.path.join(SHM_DIR, msg["segment"])
        try:
            tensors = _read_segment(path, msg["fields"])
        except FileNotFoundError:
            raise RuntimeError(
                f"row {msg['key']} from producer {msg['producer']}: segment {path} vanished before it was read "
                "(swept by another channel with the same prefix, or /dev/shm was cleaned)") from None
        finally:
            _unlink_quietly(path)
            self._release(msg["nbytes"])
        return Received("data", msg["producer"], msg["key"], msg["info"], tensors, msg["nbytes"])

    def bytes_in_flight(self) -> int:
        with self._locked():
            return self._in_flight.value

    def blocked_producers(self) -> int:
        """How many producers are waiting for capacity right now (tests use it to see backpressure)."""
        with self._locked():
            return self._blocked.value

    def close(self) -> None:
        """Owner: sweep every segment of the prefix. Producer: flush queued control messages."""
        if self._closed:
            return
        self._closed = True
        if self._owner:
            sweep_segments(self.prefix)
            _OWNERS.discard(self)
        self._control.close()
        self._control.join_thread()

    def abandon(self) -> None:
        """Producer shutting down on request: drop unsent control messages instead of waiting to flush them."""
        self._closed = True
        self._control.cancel_join_thread()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


# ---- process-wide cleanup for owner channels ---------------------------------------------------------
_OWNERS: "weakref.WeakSet[ShmChannel]" = weakref.WeakSet()
_HANDLED: dict[int, object] = {}  # signum -> the handler we chained to


def _sweep_owners() -> None:
    for ch in list(_OWNERS):
        sweep_segments(ch.prefix)


def _on_signal(signum, frame):
    _sweep_owners()
    prev = _HANDLED.get(signum)
    if callable(prev):
        return prev(signum, frame)
    if prev == signal.SIG_IGN:
        return
    # Default action, but as an exception so context managers (worker shutdown, final sweep) still run.
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise SystemExit(128 + signum)


def _install_signal_handlers() -> None:
    if threading.current_thread() is not threading.main_thread():
        return  # signal.signal only works there; atexit and close() still sweep
    for signum in (signal.SIGTERM, signal.SIGINT):
        if signum not in _HANDLED:
            _HANDLED[signum] = signal.getsignal(signum)
            signal.signal(signum, _on_signal)


atexit.register(_sweep_owners)
