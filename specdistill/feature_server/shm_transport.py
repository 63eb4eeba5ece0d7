"""A bounded channel for tensor payloads between processes, through POSIX shared memory.

Design (why each choice):
- Data path: each producer writes into its own ring file under /dev/shm (tmpfs, i.e. RAM; never regular disk),
  mapped once by the producer and once by the consumer. A payload costs the producer one memcpy into pages that
  are already mapped (a fresh file per payload would pay page allocation + faults, ~6x slower than the memcpy),
  and the consumer none: it hands out tensors that are views of the ring. Not `multiprocessing.shared_memory`:
  on Python 3.11 its resource_tracker unlinks a producer's segments when the producer exits.
- Reuse: a ring region is free again once every view of it is gone (a finalizer on the numpy base of the views,
  so slices and reshapes keep it alive); the consumer then advances that producer's tail in shared memory.
  Payloads larger than a ring go through a one-off segment file, copied out and unlinked by the consumer.
- Control path: one pipe per producer carrying metadata only (kind, key = row id, ring name and offset, per-field
  name/dtype/shape/offset/nbytes, small scalar info). `put` refuses anything else, so a tensor can never be
  pickled through it by accident. Per-producer pipes and single-writer counters (no shared lock or queue) mean a
  producer killed mid-message can only break its own stream, which then reads as end-of-stream.
- Writes in place: `reserve` sets a region aside (room waited for as in `put`) and hands out writable views of it
  plus a `location` a process of the producer's own (a vLLM engine it started) can write through (RegionWriter:
  /proc/<producer pid>/fd/<fd>, since the ring's name is gone once the consumer has mapped it); `publish` then sends
  the control message only. `put` is reserve + one copy + publish. Ring reservations are published in the order
  they were made (the consumer frees regions in ring order); one never published is skipped.
- Capacity: `capacity_bytes` is split into one ring per expected producer. A producer blocks while its ring has
  no room (backpressure); an oversized payload waits while other oversized bytes would exceed the capacity.
- Cleanup: every file name is `<prefix>-...` with a per-run prefix. The consumer unlinks a ring's name as soon as
  it has mapped it (the memory lives while either side maps it), and the owning (consumer) channel sweeps
  `<prefix>-*` at start (leftovers of a crashed run with the same prefix), at close, at interpreter exit and on
  SIGTERM/SIGINT; so a producer killed mid-write (kill -9) leaves nothing behind once the consumer closes.

Legend: P = payload bytes, R = ring bytes. Ring offsets are virtual (monotonic); physical = virtual % R.
"""

import atexit
import glob
import math
import mmap
import multiprocessing.connection
import os
import queue
import re
import shutil
import signal
import threading
import time
import uuid
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from multiprocessing.context import BaseContext

import multiprocessing as mp
import numpy as np
import torch

SHM_DIR = "/dev/shm"
_ALIGN = 64  # field offsets are cache-line aligned so the copies stay vectorised
_PREFIX_RE = re.compile(r"^[A-Za-z0-9_.]+$")  # no '-': '<prefix>-*' must never match another run's prefix
_DTYPES = {
    str(dt).removeprefix("torch."): dt
    for dt in (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32,
               torch.int16, torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn)
}
_SCALARS = (str, int, float, bool, type(None))
_POLL_S = 0.01  # a blocked producer re-checks capacity at least this often
MAX_PRODUCERS = 256  # producer ids index shared arrays: 0 <= producer_id < MAX_PRODUCERS


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
    """The /dev/shm files (rings, oversized segments) currently named with this prefix."""
    return sorted(glob.glob(os.path.join(SHM_DIR, f"{prefix}-*")))


def sweep_segments(prefix: str) -> int:
    """Remove every file or directory of this prefix; returns how many were removed."""
    removed = 0
    for path in segment_paths(prefix):
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.unlink(path)
            removed += 1
        except FileNotFoundError:  # consumed concurrently
            pass
    return removed


Layout = dict[str, tuple[torch.dtype, tuple[int, ...]]]  # field name -> (dtype, shape), in write order


def _layout(tensors: dict[str, torch.Tensor]) -> tuple[list[dict], int]:
    return _layout_of({name: (t.dtype, tuple(t.shape)) for name, t in tensors.items()})


def _layout_of(layout: Layout) -> tuple[list[dict], int]:
    """Per-field name/dtype/shape/offset/nbytes (offsets _ALIGN-aligned) and the payload's size in bytes."""
    fields, offset = [], 0
    for name, (torch_dtype, shape) in layout.items():
        dtype = str(torch_dtype).removeprefix("torch.")
        if dtype not in _DTYPES:
            raise TypeError(f"field {name!r}: dtype {torch_dtype} not supported, expected one of {sorted(_DTYPES)}")
        shape = tuple(int(n) for n in shape)
        nbytes = math.prod(shape) * _DTYPES[dtype].itemsize
        fields.append({"name": name, "dtype": dtype, "shape": shape, "offset": offset, "nbytes": nbytes})
        offset += math.ceil(nbytes / _ALIGN) * _ALIGN
    return fields, max(offset, _ALIGN)  # tmpfs cannot mmap an empty file


def _field_views(region_P: torch.Tensor, fields: list[dict]) -> dict[str, torch.Tensor]:
    """Writable typed tensors over a uint8 region (offsets are aligned, so every dtype view is legal)."""
    out = {}
    for f in fields:
        dtype, shape = _DTYPES[f["dtype"]], tuple(f["shape"])
        if not f["nbytes"]:
            out[f["name"]] = torch.empty(shape, dtype=dtype)
            continue
        out[f["name"]] = region_P[f["offset"]: f["offset"] + f["nbytes"]].view(dtype).reshape(shape)
    return out


def _create_file(path: str, size: int) -> int:
    """A new private file of `size` bytes; returns its fd (the caller maps it, and closes the fd when done)."""
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, size)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _map(fd: int, size: int) -> torch.Tensor:
    """The file as a uint8 tensor (shared mapping; it lives while any tensor over it does)."""
    return torch.frombuffer(mmap.mmap(fd, size), dtype=torch.uint8)


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


def _views(base_P: np.ndarray, fields: list[dict]) -> dict[str, torch.Tensor]:
    """Tensors over one ring region, without a copy; each keeps `base_P` (and so the region) alive."""
    out = {}
    for f in fields:
        dtype, shape = _DTYPES[f["dtype"]], tuple(f["shape"])
        if not f["nbytes"]:
            out[f["name"]] = torch.empty(shape, dtype=dtype)
            continue
        flat = torch.from_numpy(base_P[f["offset"]: f["offset"] + f["nbytes"]])
        out[f["name"]] = flat.view(dtype).reshape(shape)
    return out


@dataclass
class _Region:
    start: int  # virtual offsets in the producer's ring
    end: int
    freed: bool = False


class _ConsumerRing:
    """The consumer's side of one producer's ring: the mapping and the regions handed out, in ring order."""

    def __init__(self, name: str, size: int):
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_RDWR)
        try:
            self.mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        _unlink_quietly(path)  # mapped on both sides now: the name is no longer needed, so it cannot leak
        self.name, self.size = name, size
        self.regions: "list[_Region]" = []  # outstanding, ascending start
        self.last_end = 0

    def take(self, start: int, size_P: int) -> tuple[np.ndarray, _Region]:
        region = _Region(start, start + size_P)
        self.regions.append(region)
        self.last_end = region.end
        return np.frombuffer(self.mm, dtype=np.uint8, count=size_P, offset=start % self.size), region

    def idle(self) -> bool:
        """No region of this ring is held any more."""
        self.tail()
        return not self.regions

    def tail(self) -> int:
        """Everything before the first region still in use is free."""
        while self.regions and self.regions[0].freed:
            self.regions.pop(0)
        return self.regions[0].start if self.regions else self.last_end


def _location(key: int, fd: int, inode: int, offset: int, fields: list[dict], size_P: int, reuse: bool) -> dict:
    """Where a writer in another process finds a reserved region (metadata only: it travels in a vLLM request).

    path: /proc/<pid>/fd/<fd> of the process holding the file open, which works after the file's name is gone (the
    consumer unlinks a ring's name once it has mapped it; a memfd never had one). inode: proves the path still names
    that file. reuse: the file holds later regions too (a ring), so the writer may keep it mapped."""
    return {"key": key, "path": f"/proc/{os.getpid()}/fd/{fd}", "inode": inode, "offset": offset, "nbytes": size_P,
            "fields": fields, "reuse": reuse}


class Reservation:
    """Room for one payload, set aside before its bytes exist (ShmProducer.reserve). Write the fields through
    `tensors` (this process) or `location` (another process: RegionWriter), then `ShmProducer.publish` it."""

    def __init__(self, key: int, producer_id: int, tensors: dict[str, torch.Tensor], location: dict, msg: dict,
                 fd: int | None = None, head_before: int = 0):
        self.key, self.producer_id, self.tensors, self.location = key, producer_id, tensors, location
        self._msg = msg  # the data message publish() sends: fields, nbytes, ring name and start, or segment name
        self._fd = fd  # a one-off segment's fd, open until publish (a ring's belongs to the producer)
        self._head_before = head_before  # the ring head before this reservation (discard rolls it back)
        self.published = False

    @property
    def nbytes(self) -> int:
        return self._msg["nbytes"]


class LocalRegion:
    """A payload region in an anonymous memory file (memfd) of this process, for a writer in another process when
    no consumer is involved (VLLMBackend.extract). It has no name, so nothing can leak: the memory lives while the
    fd or a mapping does. `tensors` stay valid after close(); close once the writer is done."""

    def __init__(self, key: int, layout: Layout):
        fields, size_P = _layout_of(layout)
        self._fd = os.memfd_create(f"specdistill-row{key}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self._fd, size_P)
            self.tensors = _field_views(_map(self._fd, size_P), fields)
            self.location = _location(key, self._fd, os.fstat(self._fd).st_ino, 0, fields, size_P, reuse=False)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


@dataclass
class _ProducerRing:
    name: str
    fd: int  # held open: a writer in another process reaches the ring through /proc/<pid>/fd/<fd>
    inode: int
    ring_R: torch.Tensor  # uint8 over the whole mapping


class ShmProducer:
    """One producer's end of a ShmChannel: made by `ShmChannel.producer(id)`, passed to the producer process as
    a Process argument (or used in-process). Its control pipe and ring are its own, so a producer killed at any
    instant can corrupt nothing the other producers use."""

    def __init__(self, channel: "ShmChannel", producer_id: int, conn):
        self.prefix, self.producer_id, self._conn = channel.prefix, producer_id, conn
        self.ring_bytes, self.capacity_bytes = channel.ring_bytes, channel.capacity_bytes
        self._heads, self._tails, self._blocked = channel._heads, channel._tails, channel._blocked
        self._reserved, self._released = channel._reserved, channel._released
        self._ring: _ProducerRing | None = None
        self._published_end = 0  # end of the last ring region published (virtual offset)
        self._seq = 0
        self.blocked_seconds = 0.0  # time spent waiting for room

    def __getstate__(self):
        state = self.__dict__.copy()
        state.update(_ring=None, _published_end=0, _seq=0, blocked_seconds=0.0)
        return state

    def put(self, key: int, tensors: dict[str, torch.Tensor], *, info: dict | None = None, block: bool = True,
            timeout: float | None = None) -> None:
        """Publish one payload (one copy into the ring). Blocks for room (backpressure); ChannelFull if not block
        / timed out."""
        check_metadata_only(info or {}, f"row {key} info")
        reservation = self.reserve(key, {name: (t.dtype, tuple(t.shape)) for name, t in tensors.items()},
                                   block=block, timeout=timeout)
        try:
            for name, t in tensors.items():
                reservation.tensors[name].copy_(t.detach())
        except BaseException:
            self._discard(reservation)
            raise
        self.publish(reservation, info=info)

    def reserve(self, key: int, layout: Layout, *, block: bool = True, timeout: float | None = None) -> Reservation:
        """Room for one payload of `layout` (field name -> (dtype, shape)), to be written in place and then
        published. Blocks for room like put. ChannelFull at once when this producer's own unpublished reservations
        leave too little room in the ring for it: waiting could never end, publish them first."""
        fields, size_P = _layout_of(layout)
        msg = {"kind": "data", "key": key, "info": {}, "fields": fields, "nbytes": size_P}
        check_metadata_only(msg, f"row {key} control message")
        if size_P > self.ring_bytes:
            return self._reserve_segment(msg, block, timeout)
        return self._reserve_ring(msg, block, timeout)

    def publish(self, reservation: Reservation, *, info: dict | None = None) -> None:
        """Hand a reserved payload to the consumer: a control message only, the bytes are in place already.
        Ring reservations go in the order they were made."""
        msg = {**reservation._msg, "info": info or {}}
        check_metadata_only(msg, f"row {reservation.key} control message")
        where = f"producer {self.producer_id}: row {reservation.key}"
        if reservation.published:
            raise ValueError(f"{where} is already published")
        if "ring" in msg:
            if msg["start"] < self._published_end:
                raise ValueError(f"{where}: a later reservation was published first; publish ring reservations in "
                                 "the order they were made")
            self._published_end = msg["start"] + msg["nbytes"]
        self._conn.send(msg)
        reservation.published = True
        reservation.tensors = {}  # the region is the consumer's now: no more writes through these views
        if reservation._fd is not None:
            os.close(reservation._fd)  # the consumer opens a segment by name
            reservation._fd = None

    def send(self, kind: str, *, key: int | None = None, info: dict | None = None) -> None:
        """A metadata-only message (ready / done / error...) on the same ordered control path."""
        if kind == "data":
            raise ValueError("kind 'data' is reserved for put() and publish()")
        msg = {"kind": kind, "key": key, "info": info or {}}
        check_metadata_only(msg, f"{kind} control message")
        self._conn.send(msg)

    def close(self) -> None:
        """Done producing: the consumer sees end-of-stream once every copy of this end is closed."""
        if self._ring is not None:
            os.close(self._ring.fd)
            self._ring = None  # unmapped when the last tensor over it is gone
        self._conn.close()

    abandon = close  # pipe sends are synchronous: nothing is left to flush or to drop

    def _reserve_ring(self, msg: dict, block: bool, timeout: float | None) -> Reservation:
        pid, size_P, R = self.producer_id, msg["nbytes"], self.ring_bytes
        ring = self._ensure_ring()
        head = self._heads[pid]
        pos = head % R
        waste = R - pos if pos + size_P > R else 0  # a payload never wraps: skip the ring's tail end
        if R - (head - self._published_end) < waste + size_P:
            raise ChannelFull(f"producer {pid}: {head - self._published_end} bytes reserved and not published leave "
                              f"no room for {size_P} more in a ring of {R}; publish them first")
        self._wait_for_room(lambda: R - (head - self._tails[pid]) >= waste + size_P,
                            f"producer {pid}: ring of {R} bytes has no room for {size_P} more", block, timeout)
        start = head + waste
        self._heads[pid] = start + size_P  # in flight from now on: the room check counts it
        pos = start % R
        tensors = _field_views(ring.ring_R[pos: pos + size_P], msg["fields"])
        location = _location(msg["key"], ring.fd, ring.inode, pos, msg["fields"], size_P, reuse=True)
        return Reservation(msg["key"], pid, tensors, location,
                           {**msg, "ring": ring.name, "ring_bytes": R, "start": start}, head_before=head)

    def _ensure_ring(self) -> _ProducerRing:
        if self._ring is None:
            name = f"{self.prefix}-ring{self.producer_id}-{os.getpid()}"
            fd = _create_file(os.path.join(SHM_DIR, name), self.ring_bytes)
            self._heads[self.producer_id] = self._tails[self.producer_id] = 0  # this id starts afresh
            self._published_end = 0
            self._ring = _ProducerRing(name, fd, os.fstat(fd).st_ino, _map(fd, self.ring_bytes))
        return self._ring

    def _reserve_segment(self, msg: dict, block: bool, timeout: float | None) -> Reservation:
        pid, size_P = self.producer_id, msg["nbytes"]

        def oversized_in_flight() -> int:
            return sum(self._reserved[i] - self._released[i] for i in range(MAX_PRODUCERS))

        # Lock-free, so soft: producers racing here may overshoot the capacity by one payload each.
        self._wait_for_room(lambda: oversized_in_flight() == 0 or oversized_in_flight() + size_P <= self.capacity_bytes,
                            f"{oversized_in_flight()} oversized bytes in flight + {size_P} > capacity "
                            f"{self.capacity_bytes}", block, timeout)
        segment = f"{self.prefix}-{pid}-{os.getpid()}-{self._seq}"
        self._seq += 1
        path = os.path.join(SHM_DIR, segment)
        self._reserved[pid] += size_P
        fd = None
        try:
            fd = _create_file(path, size_P)
            tensors = _field_views(_map(fd, size_P), msg["fields"])
            location = _location(msg["key"], fd, os.fstat(fd).st_ino, 0, msg["fields"], size_P, reuse=False)
        except BaseException:
            if fd is not None:
                os.close(fd)
            _unlink_quietly(path)
            self._reserved[pid] -= size_P
            raise
        return Reservation(msg["key"], pid, tensors, location, {**msg, "segment": segment}, fd=fd)

    def _discard(self, reservation: Reservation) -> None:
        """Give up the newest reservation, unpublished (put's copy failed): its room is free again."""
        reservation.tensors = {}
        msg, pid = reservation._msg, self.producer_id
        if "ring" in msg:
            if self._heads[pid] == msg["start"] + msg["nbytes"]:
                self._heads[pid] = reservation._head_before
            return
        os.close(reservation._fd)
        reservation._fd = None
        _unlink_quietly(os.path.join(SHM_DIR, msg["segment"]))
        self._reserved[pid] -= reservation.nbytes

    def _wait_for_room(self, has_room, why: str, block: bool, timeout: float | None) -> None:
        if has_room():
            return
        if not block:
            raise ChannelFull(why)
        deadline = None if timeout is None else time.monotonic() + timeout
        t0 = time.monotonic()
        self._blocked[self.producer_id] = 1
        try:
            while not has_room():
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise ChannelFull(why)
                # A poll, not a wake-up: a multiprocessing Semaphore is a named POSIX semaphore that a kill -9 of
                # the run leaves in /dev/shm. A blocked producer means the trainer is the bottleneck, so the
                # poll's latency (at most _POLL_S) costs nothing.
                time.sleep(_POLL_S if remaining is None else min(_POLL_S, remaining))
        finally:
            self._blocked[self.producer_id] = 0
            self.blocked_seconds += time.monotonic() - t0


class ShmChannel:
    """Many producers -> one consumer. Create it in the consumer (the owner); `producer(id)` makes the end a
    producer process uses (pass it as a Process argument, then call `started(id)`); `get` here. The owner sweeps
    the files; see the module doc. In-process producers (tests) can call `put`/`send` here directly.

    producers: how many producers share `capacity_bytes` (one ring of capacity_bytes // producers each).
    Producer ids are 0 <= id < MAX_PRODUCERS, one per producer process; a replacement gets a new id.
    """

    def __init__(self, capacity_bytes: int, *, prefix: str | None = None, ctx: BaseContext | None = None,
                 handle_signals: bool = True, producers: int = 1):
        if not os.path.isdir(SHM_DIR):
            raise RuntimeError(f"{SHM_DIR} is missing: the transport needs POSIX shared memory (tmpfs)")
        self.prefix = prefix or f"sdshm_{os.getpid()}_{uuid.uuid4().hex[:8]}"
        if not _PREFIX_RE.match(self.prefix):
            raise ValueError(f"channel prefix {self.prefix!r} must match {_PREFIX_RE.pattern} (no '-' or '/')")
        if capacity_bytes < 1 or producers < 1:
            raise ValueError(f"capacity_bytes and producers must be >= 1, got {capacity_bytes}, {producers}")
        self._ctx = ctx or mp.get_context("spawn")
        self.capacity_bytes = int(capacity_bytes)
        self.ring_bytes = max(_ALIGN, self.capacity_bytes // producers // _ALIGN * _ALIGN)
        # Every shared value has one writer (no lock a killed producer could hold): heads, reserved and blocked
        # are written by their producer, tails and released by the consumer.
        self._heads = self._ctx.RawArray("q", MAX_PRODUCERS)
        self._tails = self._ctx.RawArray("q", MAX_PRODUCERS)
        self._reserved = self._ctx.RawArray("q", MAX_PRODUCERS)  # oversized bytes ever reserved
        self._released = self._ctx.RawArray("q", MAX_PRODUCERS)  # oversized bytes ever taken by the consumer
        self._blocked = self._ctx.RawArray("b", MAX_PRODUCERS)
        self._readers: dict[int, object] = {}  # producer id -> read end of its control pipe
        self._writers: dict[int, object] = {}  # our copies of the write ends, until the producer has started
        self._local: dict[int, ShmProducer] = {}
        self._rings: dict[int, _ConsumerRing] = {}
        self._retired: set[int] = set()  # dead producers whose ring is dropped once its last view is gone
        self._order: list[int] = []  # round-robin over producers with messages waiting
        self._closed = False
        self._advancing = False
        sweep_segments(self.prefix)  # a crashed earlier run with the same prefix
        _OWNERS.add(self)
        if handle_signals:
            _install_signal_handlers()

    def __getstate__(self):
        raise TypeError("a ShmChannel stays in the consumer; pass channel.producer(id) to producer processes")

    # ---- producers -----------------------------------------------------------------------------------
    def producer(self, producer_id: int) -> ShmProducer:
        if not 0 <= producer_id < MAX_PRODUCERS:
            raise ValueError(f"producer_id {producer_id} outside [0, {MAX_PRODUCERS})")
        if producer_id in self._readers:
            raise ValueError(f"producer id {producer_id} already has an end; give each producer its own id")
        reader, writer = self._ctx.Pipe(duplex=False)
        self._readers[producer_id], self._writers[producer_id] = reader, writer
        self._order.append(producer_id)
        return ShmProducer(self, producer_id, writer)

    def started(self, producer_id: int) -> None:
        """The producer process holds its own copy now: close ours, so its exit reads as end-of-stream."""
        self._writers.pop(producer_id).close()

    def put(self, key: int, tensors: dict[str, torch.Tensor], *, producer_id: int = 0, **kwargs) -> None:
        self._local_producer(producer_id).put(key, tensors, **kwargs)

    def reserve(self, key: int, layout: Layout, *, producer_id: int = 0, **kwargs) -> Reservation:
        return self._local_producer(producer_id).reserve(key, layout, **kwargs)

    def publish(self, reservation: Reservation, **kwargs) -> None:
        self._local_producer(reservation.producer_id).publish(reservation, **kwargs)

    def send(self, kind: str, *, producer_id: int = 0, **kwargs) -> None:
        self._local_producer(producer_id).send(kind, **kwargs)

    def _local_producer(self, producer_id: int) -> ShmProducer:
        if producer_id not in self._local:
            self._local[producer_id] = self.producer(producer_id)
        return self._local[producer_id]

    # ---- consumer side -------------------------------------------------------------------------------
    def get(self, timeout: float | None = None) -> Received:
        """Next message, round-robin over producers; raises queue.Empty after timeout. A producer whose every
        write end is closed (it exited, or was killed) yields one Received(kind="eof") and is forgotten.

        Ring payloads arrive as views of the ring (no copy): the region is reused once the last view is gone,
        so holding samples holds capacity. Oversized payloads are copied out and their segment unlinked."""
        ready = mp.connection.wait(list(self._readers.values()), timeout)
        if not ready:
            raise queue.Empty
        by_conn = {id(c): pid for pid, c in self._readers.items()}
        waiting = {by_conn[id(c)] for c in ready}
        pid = next(p for p in self._order if p in waiting)
        self._order.remove(pid)
        self._order.append(pid)  # served last next time: one busy producer cannot starve the others
        try:
            msg = self._readers[pid].recv()
        except (EOFError, OSError):
            self._readers.pop(pid).close()
            self._order.remove(pid)
            return Received("eof", pid, None, {})
        if msg["kind"] != "data":
            return Received(msg["kind"], pid, msg["key"], msg["info"])
        if "ring" in msg:
            return Received("data", pid, msg["key"], msg["info"], self._take_ring(pid, msg), msg["nbytes"])
        path = os.path.join(SHM_DIR, msg["segment"])
        try:
            tensors = _read_segment(path, msg["fields"])
        except FileNotFoundError:
            raise RuntimeError(
                f"row {msg['key']} from producer {pid}: segment {path} vanished before it was read "
                "(swept by another channel with the same prefix, or /dev/shm was cleaned)") from None
        finally:
            _unlink_quietly(path)
            self._released[pid] += msg["nbytes"]
        return Received("data", pid, msg["key"], msg["info"], tensors, msg["nbytes"])

    def _take_ring(self, pid: int, msg: dict) -> dict[str, torch.Tensor]:
        ring = self._rings.get(pid)
        if ring is None:
            try:
                ring = self._rings[pid] = _ConsumerRing(msg["ring"], msg["ring_bytes"])
            except FileNotFoundError:
                raise RuntimeError(f"row {msg['key']} from producer {pid}: ring {msg['ring']} vanished before it "
                                   "was mapped (swept by another channel with the same prefix?)") from None
        base_P, region = ring.take(msg["start"], msg["nbytes"])
        weakref.finalize(base_P, self._free, region)
        return _views(base_P, msg["fields"])

    def _free(self, region: _Region) -> None:
        """Finalizer of a region's last view: publish the new tails and wake blocked producers."""
        region.freed = True
        if self._advancing or self._closed:  # re-entered (GC inside the loop) or shutting down
            return
        self._advancing = True
        try:
            for pid, ring in list(self._rings.items()):
                self._tails[pid] = ring.tail()
            self._drop_retired_rings()
        finally:
            self._advancing = False

    def release_producer(self, producer_id: int) -> None:
        """A producer died: return the oversized capacity it reserved but never delivered, and unmap its ring as
        soon as no sample of it is held (a dead worker's ring is ~2.7 GB with the node preset; a run outlives many
        workers)."""
        self._released[producer_id] = self._reserved[producer_id]
        self._retired.add(producer_id)
        self._drop_retired_rings()

    def _drop_retired_rings(self) -> None:
        for pid in list(self._retired):
            ring = self._rings.get(pid)
            if ring is None or ring.idle():
                self._rings.pop(pid, None)  # the mapping closes with its last reference
                self._retired.discard(pid)

    @property
    def mapped_rings(self) -> int:
        """Rings this consumer maps now (tests: a dead producer's ring does not stay)."""
        return len(self._rings)

    def bytes_in_flight(self) -> int:
        """Ring bytes written and not yet free again, plus oversized bytes in flight."""
        return sum(self._heads[p] - self._tails[p] + self._reserved[p] - self._released[p]
                   for p in range(MAX_PRODUCERS))

    def blocked_producers(self) -> int:
        """How many producers are waiting for room right now (tests use it to see backpressure)."""
        return sum(self._blocked)

    def close(self) -> None:
        """Sweep every file of the prefix and close the control pipes."""
        if self._closed:
            return
        self._closed = True
        sweep_segments(self.prefix)
        _OWNERS.discard(self)
        for producer in self._local.values():
            producer.close()
        for conn in [*self._readers.values(), *self._writers.values()]:
            conn.close()
        self._readers.clear()
        self._writers.clear()
        self._local.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class RegionWriter:
    """Writes tensors into regions that a producer in another process reserved (`Reservation.location`): a vLLM
    engine writing a request's hidden states straight into its feature worker's ring.

    Opens the region's file through the producer's /proc/<pid>/fd/<fd> path (the producer holds the fd open until it
    publishes; the name may be gone), checks it is the same file (inode) and large enough, and keeps rings mapped
    for their next regions (one-off files are unmapped after the write). Same user only: /proc/<pid>/fd follows the
    ptrace read-access rule, which a process of the same user that is not setuid passes.
    """

    _MAX_KEPT = 4  # rings kept mapped: one per producer this writer serves

    def __init__(self):
        self._kept: "OrderedDict[tuple[str, int], torch.Tensor]" = OrderedDict()

    def write(self, location: dict, tensors: dict[str, torch.Tensor]) -> None:
        """Copy each tensor into its field, in the order given (write the field a reader checks last, last),
        casting to the field's dtype on the way. Raises, naming the row and field, on an unknown field, a shape
        mismatch or a file that is not the producer's."""
        row = f"row {location['key']}"
        fields = {f["name"]: f for f in location["fields"]}
        unknown = [name for name in tensors if name not in fields]
        if unknown:
            raise KeyError(f"{row}: fields {unknown} are not in its region (it has {sorted(fields)})")
        offset = location["offset"]
        region_P = self._mapping(location)[offset: offset + location["nbytes"]]
        views = _field_views(region_P, [fields[name] for name in tensors])
        for name, src in tensors.items():
            dst = views[name]
            if tuple(src.shape) != tuple(dst.shape):
                raise ValueError(f"{row}: field {name!r} got shape {tuple(src.shape)}, its region holds "
                                 f"{tuple(dst.shape)}")
            if src.device.type != "cpu":
                src = src.to(dst.dtype)  # cast on the device: fewer bytes cross the bus
            dst.copy_(src)  # on CPU the cast is part of this one pass

    def _mapping(self, location: dict) -> torch.Tensor:
        ident = (location["path"], location["inode"])
        if ident in self._kept:
            self._kept.move_to_end(ident)
            return self._kept[ident]
        try:
            fd = os.open(location["path"], os.O_RDWR)
        except OSError as e:
            raise RuntimeError(f"row {location['key']}: cannot open its region file {location['path']} ({e}); the "
                               "producer must be alive, hold it open and run as this user") from None
        try:
            st = os.fstat(fd)
            if st.st_ino != location["inode"] or st.st_size < location["offset"] + location["nbytes"]:
                raise RuntimeError(f"row {location['key']}: {location['path']} is inode {st.st_ino} of {st.st_size} "
                                   f"bytes, not the producer's region file (inode {location['inode']}, at least "
                                   f"{location['offset'] + location['nbytes']} bytes)")
            file_P = _map(fd, st.st_size)
        finally:
            os.close(fd)
        if location["reuse"]:
            self._kept[ident] = file_P
            while len(self._kept) > self._MAX_KEPT:
                self._kept.popitem(last=False)  # unmapped once nothing else holds it
        return file_P


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
