"""Packs to a CUDA trainer (specdistill/trainer/device_copy.py): assembled in pinned buffers that are reused once
their copy is done, copied on a side stream, equal on the device to what was assembled, in the order the streams
need. GPU only: pinned memory and streams need a CUDA device (bench/gpu_check.sh runs these); the CPU path is the host
pack itself. The pool's bookkeeping and the host allocator's rounding run here on ordinary memory.

The ordering tests hold one stream back with a long kernel (torch.cuda._sleep) so that a missing wait shows: with
`wait_event` removed the step reads a pack's device memory before its copy lands, with `record_stream` removed the
next pack's copy overwrites memory the step has yet to read, and a pageable copy on the side stream makes stage()
wait for the held-back stream."""

import time

import pytest
import torch

from specdistill.core.batch import PackAssembler, new_pack_buffers
from specdistill.core.contract import FeatureSample, TokenizedRow
from specdistill.core.rows import as_rows
from specdistill.trainer.device_copy import (DeviceCopier, PinnedBuffers, on_device, pinned_block_bytes,
                                             pinned_host_peak_bytes)

LAYERS, D = (1, 2), 8
# Packs of two 2,048-token rows, 2 layers x 1,024 bf16: 16 MiB of states, a ~1 ms copy.
LONG_ROW, WIDE = 2048, 1024
# A kernel of ~2^30 GPU cycles (~0.5 s at an H100's or H200's ~2 GHz): far longer than staging a pack on the host.
SLEEP_CYCLES = 2**30


def gpu_only(test):
    needs = pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory and CUDA streams need a CUDA device")
    return pytest.mark.gpu(needs(test))


def _stream(rows, width=D, seed=0):
    g = torch.Generator().manual_seed(seed)
    for r in rows:
        yield FeatureSample(r.row_id, torch.tensor(r.input_ids), torch.tensor(r.loss_mask).bool(),
                            torch.randn(len(r.input_ids), len(LAYERS), width, generator=g).bfloat16())


def _rows(n=10):
    return as_rows([TokenizedRow(i, tuple(range(3 + i)), (0, 0) + (1,) * (1 + i)) for i in range(n)])


def _big_packs(copier: DeviceCopier, n: int, seed: int) -> list:
    """n packs of two long rows in the copier's pinned buffers, each with a copy of its tensors taken before any is
    staged; token ids and states differ from pack to pack (and from test to test: `seed`)."""
    g = torch.Generator().manual_seed(seed)
    rows = as_rows([TokenizedRow(i, tuple(torch.randint(0, 30_000, (LONG_ROW,), generator=g).tolist()),
                                 (0,) * (LONG_ROW // 2) + (1,) * (LONG_ROW // 2)) for i in range(2 * n)])
    assembler = PackAssembler(rows, [2] * n, LAYERS, buffers=copier.pool)
    packs = [p for s in _stream(rows, WIDE, seed) if (p := assembler.add(s)) is not None]
    return [(p, {k: t.clone() for k, t in p.tensors().items()}) for p in packs]


def _assert_equal(got: dict, want: dict) -> None:
    for key, tensor in want.items():
        torch.testing.assert_close(got[key].cpu(), tensor.to(got[key].dtype), msg=key)


def _read(staged) -> dict:
    """What the step reads of a staged pack, queued on the current stream: every tensor, states cast to fp32."""
    return {k: t.clone() for k, t in on_device(staged, torch.device("cuda"), torch.float32).tensors().items()}


def _warm_up(copier: DeviceCopier, pack) -> None:
    """One pack through stage and read, then idle: the packs of its size that follow find their pinned and device
    memory cached (a new allocation, cudaHostAlloc or cudaMalloc, may wait for the device and hide the order)."""
    _read(copier.stage(pack))
    torch.cuda.synchronize()


@gpu_only
def test_packs_copied_from_reused_pinned_buffers_equal_the_assembled_ones():
    device = torch.device("cuda")
    copier = DeviceCopier(device)
    rows = _rows(10)
    assembler = PackAssembler(rows, [2] * 5, LAYERS, pad_to=64, buffers=copier.pool)
    staged, expected = [], []
    for sample in _stream(rows):
        pack = assembler.add(sample)
        if pack is not None:
            expected.append({k: t.clone() for k, t in pack.tensors().items()})  # before the buffers are reused
            assert pack.hidden_TLD.is_pinned()
            staged.append(copier.stage(pack))
    assert len(staged) == 5 and copier.pool.allocated <= 2  # packs complete one at a time: the buffers come back
    for item, want in zip(staged, expected):
        got = on_device(item, device, torch.float32)
        assert got.hidden_TLD.device.type == "cuda" and got.hidden_TLD.dtype == torch.float32
        _assert_equal(got.tensors(), want)


@gpu_only
def test_a_pack_held_back_on_the_copy_stream_is_staged_at_once_and_read_only_once_copied():
    """A long kernel on the copier's stream holds the copy back. stage() returns at once (the pack's ids go through
    pinned memory: a non_blocking copy from pageable memory first waits for the stream); the step's reads, queued on
    its stream at once, see the pack (wait_event: without it they read device memory the copy has not written, here
    the warm-up pack's); and waiting for the copy's event sleeps instead of spinning a core (a blocking event)."""
    copier = DeviceCopier(torch.device("cuda"))
    (warm, _), (pack, want) = _big_packs(copier, 2, seed=1)
    _warm_up(copier, warm)
    with torch.cuda.stream(copier.stream):
        torch.cuda._sleep(SLEEP_CYCLES)
    slept = torch.cuda.Event()
    slept.record(copier.stream)
    staged = copier.stage(pack)
    assert not slept.query(), "stage() waited for the copy stream"
    read = _read(staged)
    wall, cpu = time.perf_counter(), time.process_time()
    staged.copied.synchronize()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    assert cpu < wall / 2, f"waiting {wall:.3f} s for the copy's event took {cpu:.3f} s of CPU"
    torch.cuda.synchronize()
    _assert_equal(read, want)


@gpu_only
def test_a_packs_device_memory_is_not_reused_while_the_step_still_reads_it():
    """The step's stream is busy when pack A arrives; A's device tensors (allocated on the copier's stream) are dropped
    as soon as the step has queued its reads, and pack B, of A's size, is staged at once. Without record_stream the
    allocator hands A's memory to B's copy, which runs before the step has read A."""
    copier = DeviceCopier(torch.device("cuda"))
    (warm, _), (pack_a, want_a), (pack_b, want_b) = _big_packs(copier, 3, seed=2)
    _warm_up(copier, warm)
    staged_a = copier.stage(pack_a)
    staged_a.copied.synchronize()  # A's pinned ids are free again for B: no new pinned allocation below
    torch.cuda._sleep(SLEEP_CYCLES)  # the step, still running on the main stream
    read_a = _read(staged_a)  # queued behind the step
    del staged_a  # the step's last reference: only its queued reads still use A's memory
    read_b = _read(copier.stage(pack_b))  # the copy stream is idle: B is copied now, while the step still runs
    torch.cuda.synchronize()
    _assert_equal(read_a, want_a)
    _assert_equal(read_b, want_b)


@gpu_only
def test_the_pinned_memory_of_a_pool_buffer_is_its_request_rounded_up_to_a_power_of_two():
    """metrics.json pinned_pool_mib counts the pool's requests; torch's caching host allocator pins each rounded up
    (pinned_block_bytes), which pinned_host_mib reports."""
    torch.cuda.init()  # host_memory_stats() is empty until CUDA is initialised (a run's trainer has done it)
    before = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
    pool = PinnedBuffers()
    buffers = pool(70_000, 1, 1_000, torch.bfloat16)  # 140 MB of states: a 256 MiB block, a size no other test pins
    grown = torch.cuda.host_memory_stats()["allocated_bytes.current"] - before
    states = buffers["hidden_TLD"].nbytes
    assert pinned_block_bytes(states) == 2**28 > pool.bytes
    # The ids' and mask's blocks may be ones freed by an earlier test, kept pinned by the allocator for reuse.
    assert 2**28 <= grown <= sum(pinned_block_bytes(t.nbytes) for t in buffers.values())
    assert pinned_host_peak_bytes() >= before + grown


def test_the_pool_keeps_a_few_buffers_of_unpadded_lengths_not_one_per_pack():
    """Unpadded packs (trainer.pad_packs=false on CUDA) each have a length of their own: the pool reuses what fits
    and frees the oldest others (after their copy), instead of growing by a pack per step."""

    class Done:  # a copy event that has completed
        synchronized = 0

        def synchronize(self):
            Done.synchronized += 1

    class Ordinary(PinnedBuffers):  # pageable memory: no CUDA here
        @staticmethod
        def _allocate(*shape):
            return new_pack_buffers(*shape)

    pool = Ordinary()
    for tokens in [100 + i for i in range(30)] + [100, 100]:  # 30 lengths, then one seen before
        buffers = pool(tokens, 2, 8, torch.bfloat16)
        pool.release(type("Pack", (), {"hidden_TLD": buffers["hidden_TLD"]})(), Done())
    assert pool.allocated == 31 and len(pool._free) == PinnedBuffers.MAX_FREE  # the last 100 reused the one before
    held = sum(t.numel() * t.element_size() for _, buffers, _ in pool._free for t in buffers.values())
    assert pool.bytes == held  # what the pool holds now, not all it ever made
    # The most held at once: 4 waiting (lengths 125-128) and the one lent (129), 41 bytes a token (ids 8, mask 1,
    # states 2 layers x 8 x bf16).
    assert pool.peak_bytes == 41 * sum(range(125, 130))
    assert Done.synchronized >= 30 - PinnedBuffers.MAX_FREE  # every freed buffer's copy waited for


def test_pinned_blocks_are_requests_rounded_up_to_a_power_of_two():
    """What a node's pinned memory is made of (docs/scaling.md, "Memory of a node")."""
    assert pinned_block_bytes(32_768 * 6 * 2_048 * 2) == 2**30  # the node preset's pack states, 805 MB: 1 GiB
    assert pinned_block_bytes(32_768 * 9 * 2_048 * 2) == 2**31  # a union of 9 layers (two drafters), 1.2 GB: 2 GiB
    assert pinned_block_bytes(2**18) == 2**18 and pinned_block_bytes(2**18 + 1) == 2**19
    assert pinned_block_bytes(0) == 0 and pinned_block_bytes(1) == 1
