"""Packs to a CUDA trainer: assembled in pinned host buffers, copied on a side stream ahead of the step, cast there.

A feature byte crosses host memory once on the trainer's side: the feed copies each sample out of its worker's
shared-memory ring into its pack's buffer (core/batch.py PackAssembler), and that buffer is page-locked, so the copy
to the GPU is a DMA that needs no staging copy by the driver. The copy is issued from the feed thread on a side
stream as soon as the pack is complete, so it overlaps the step running on the default stream; the step's stream
waits on the copy's event, and the states are cast to the training dtype on the device. A blocking `.to(device,
float32)` of a pageable bf16 pack instead converts on the host (a second, twice as large buffer), then stages it
through pinned memory (a third copy), on the thread that launches the step (docs/scaling.md, "Host copies").

The pool holds a buffer per pack being assembled plus the ones whose copy has not finished: it grows to what the
feed needs at once and then reuses (`PinnedBuffers.allocated`: buffers made, `.bytes`: held now, `.peak_bytes`;
docs/scaling.md counts it). Those are the pool's requests: torch's caching host allocator, which serves them, pins a
power of two for each (`pinned_block_bytes`) and keeps a freed block pinned for reuse, so what the process really pins
is `pinned_host_peak_bytes()` (metrics.json `pinned_host_mib`, beside the pool's `pinned_pool_mib`).

Nothing on the copy path blocks the feed thread on the side stream: a pack's other tensors (its document and position
ids, built on the host when it completes) are staged through pinned memory too, since a `non_blocking` copy from
pageable memory first waits for everything queued on the stream (the previous packs' copies); and the copy's event is
a blocking one, so a wait on it (a buffer's reuse) sleeps instead of spinning a core.
"""

import threading
from dataclasses import dataclass, replace

import torch

from specdistill.core.batch import PackedBatch, new_pack_buffers


def pinned_block_bytes(nbytes: int) -> int:
    """What torch's caching host allocator pins for a request of `nbytes`: the next power of two (its default, unless
    PYTORCH_ALLOC_CONF's pinned_max_round_threshold_mb stops the rounding above a size). A 32k-token pack's 805 MB of
    states pins 1 GiB."""
    return 1 << (nbytes - 1).bit_length() if nbytes > 0 else 0


def pinned_host_peak_bytes() -> int:
    """The most host memory torch's caching host allocator held pinned in this process: rounded blocks, in use or
    kept for reuse (torch sums each block size's peak: exact while no block is freed back to CUDA, which it does
    only when asked, an upper bound otherwise); 0 where CUDA was never initialised."""
    return int(torch.cuda.host_memory_stats().get("allocated_bytes.peak", 0))


class PinnedBuffers:
    """Page-locked pack buffers (PackAssembler's `buffers` hook), reused once the copy that read them is done.

    A buffer is reused for a pack of its exact shape: padded packs (trainer.pad_packs, the default on CUDA) all have
    one. Unpadded packs have a length each, so at most MAX_FREE buffers are kept waiting for reuse and the oldest
    beyond them are freed (after their copy): otherwise the pool would grow by a pack per step."""

    MAX_FREE = 4

    def __init__(self):
        self._free: list[tuple[tuple, dict, torch.cuda.Event]] = []  # (shape key, buffers, the copy that read them)
        self._lent: dict[int, tuple[tuple, dict]] = {}  # hidden buffer's address -> (shape key, buffers)
        self._lock = threading.Lock()
        self.allocated = 0
        self.bytes = 0  # held now
        self.peak_bytes = 0  # the most held at once (metrics.json pinned_pool_mib)

    def __call__(self, tokens: int, layers: int, hidden: int, dtype: torch.dtype, response_tokens: int = 0,
                 response_layers: int = 0, scaled: bool = False) -> dict[str, torch.Tensor]:
        key = (tokens, layers, hidden, dtype, response_tokens, response_layers, scaled)  # new_pack_buffers' order
        with self._lock:
            reusable = next((i for i, (k, _, _) in enumerate(self._free) if k == key), None)
            if reusable is not None:
                _, buffers, copied = self._free.pop(reusable)
            else:
                copied, buffers = None, self._new(key)
            self._lent[buffers["hidden_TLD"].data_ptr()] = (key, buffers)
        if copied is not None:
            copied.synchronize()  # the DMA that read it must be done before the feed writes into it again
        return buffers

    def _new(self, key: tuple) -> dict[str, torch.Tensor]:
        buffers = self._allocate(*key)
        self.allocated += 1
        self.bytes += sum(t.numel() * t.element_size() for t in buffers.values())
        self.peak_bytes = max(self.peak_bytes, self.bytes)
        return buffers

    @staticmethod
    def _allocate(*shape) -> dict[str, torch.Tensor]:
        return new_pack_buffers(*shape, pin_memory=True)

    def release(self, batch: PackedBatch, copied: torch.cuda.Event) -> None:
        """The pack's buffers go back to the pool; they are handed out again once `copied` has completed."""
        with self._lock:
            key, buffers = self._lent.pop(batch.hidden_TLD.data_ptr())
            self._free.append((key, buffers, copied))
            dropped, self._free = self._free[:-self.MAX_FREE], self._free[-self.MAX_FREE:]
            for _, old, _ in dropped:
                self.bytes -= sum(t.numel() * t.element_size() for t in old.values())
        for _, _, old_copy in dropped:
            old_copy.synchronize()  # their DMA done before the page-locked memory goes back


@dataclass
class StagedPack:
    """A pack whose copy to the device was issued on the copier's stream; `ready()` orders the current stream
    after it and returns the device pack."""

    batch: PackedBatch
    copied: torch.cuda.Event

    def ready(self) -> PackedBatch:
        stream = torch.cuda.current_stream(self.batch.hidden_TLD.device)
        stream.wait_event(self.copied)
        for tensor in self.batch.tensors().values():
            tensor.record_stream(stream)  # allocated on the side stream, used and freed on this one
        return self.batch


class DeviceCopier:
    """Issues each complete pack's host-to-device copy on a side stream (called from the feed thread)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.pool = PinnedBuffers()

    def stage(self, batch: PackedBatch) -> StagedPack:
        with torch.cuda.stream(self.stream):
            moved = {name: _pinned(t).to(self.device, non_blocking=True) for name, t in batch.tensors().items()}
            copied = torch.cuda.Event(blocking=True)  # synchronize() sleeps until the copy is done
            copied.record(self.stream)
        self.pool.release(batch, copied)
        return StagedPack(replace(batch, **moved), copied)


def _pinned(t: torch.Tensor) -> torch.Tensor:
    """t in page-locked memory: as it is (the pool's buffers), or copied there (a pack's ids, 256 KiB each at 32k
    tokens; torch's caching host allocator keeps the block until the copy that reads it is done)."""
    return t if t.is_pinned() else t.pin_memory()


def on_device(item: "PackedBatch | StagedPack", device: torch.device, dtype: torch.dtype) -> PackedBatch:
    """A feed item as the step takes it: on `device`, states in `dtype` (cast on the device)."""
    batch = item.ready() if isinstance(item, StagedPack) else item
    return batch.to(device, dtype)


class StepPacks:
    """A step's packs as every drafter of the run reads them, `steps` micro-batches long (past `items`, the caller
    repeats the last at weight 0), each real pack's loss weighted by `weight`. One pack, the usual step, is cast to
    fp32 once and shared; several are cast each time one is read, so the step holds one fp32 copy at a time beside
    the packs as they came (on the device in bf16 from the copier, or on the host)."""

    def __init__(self, micro: list, device: torch.device, steps: int, weight: float):
        self.items = [item.ready() if isinstance(item, StagedPack) else item for item in micro]
        self.device, self.steps, self.weight = device, steps, weight
        self._one = self._cast(self.items[0]) if len(self.items) == 1 else None

    def _cast(self, batch: PackedBatch) -> PackedBatch:
        return batch.to(self.device, torch.float32)

    def __getitem__(self, i: int) -> PackedBatch:
        return self._one if self._one is not None else self._cast(self.items[i])
