"""Packs to a CUDA trainer (specdistill/trainer/device_copy.py): assembled in pinned buffers that are reused once
their copy is done, copied on a side stream, equal on the device to what was assembled. GPU only: pinned memory
and streams need a CUDA device (bench/gpu_check.sh runs these); the CPU path is the host pack itself. The pool's
bookkeeping runs here on ordinary memory."""

import pytest
import torch

from specdistill.core.batch import PackAssembler
from specdistill.core.contract import FeatureSample, TokenizedRow
from specdistill.core.rows import as_rows
from specdistill.trainer.device_copy import DeviceCopier, PinnedBuffers, on_device

LAYERS, D = (1, 2), 8


def _stream(rows):
    g = torch.Generator().manual_seed(0)
    for r in rows:
        yield FeatureSample(r.row_id, torch.tensor(r.input_ids), torch.tensor(r.loss_mask).bool(),
                            torch.randn(len(r.input_ids), len(LAYERS), D, generator=g).bfloat16())


def _rows(n=10):
    return as_rows([TokenizedRow(i, tuple(range(3 + i)), (0, 0) + (1,) * (1 + i)) for i in range(n)])


def test_a_host_pack_is_cast_where_it_is():
    rows = _rows(2)
    pack = PackAssembler(rows, [2], LAYERS, pad_to=32)
    batch = [b for s in _stream(rows) if (b := pack.add(s)) is not None][0]
    moved = on_device(batch, torch.device("cpu"), torch.float32)
    assert moved.hidden_TLD.dtype == torch.float32 and moved.num_tokens == 32 and moved.num_real_tokens == 7


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory and CUDA streams need a CUDA device")
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
        for key, tensor in want.items():
            torch.testing.assert_close(getattr(got, key).cpu(), tensor.to(getattr(got, key).dtype), msg=key)


def test_the_pool_keeps_a_few_buffers_of_unpadded_lengths_not_one_per_pack():
    """Unpadded packs (trainer.pad_packs=false on CUDA) each have a length of their own: the pool reuses what fits
    and frees the oldest others (after their copy), instead of growing by a pack per step."""

    class Done:  # a copy event that has completed
        synchronized = 0

        def synchronize(self):
            Done.synchronized += 1

    class Ordinary(PinnedBuffers):  # pageable memory: no CUDA here
        @staticmethod
        def _allocate(tokens, layers, hidden, dtype):
            return {"input_ids_T": torch.empty(tokens, dtype=torch.int64),
                    "loss_mask_T": torch.empty(tokens, dtype=torch.bool),
                    "hidden_TLD": torch.empty(tokens, layers, hidden, dtype=dtype)}

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
