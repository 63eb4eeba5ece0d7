"""Every drafter trains under the trainer's GPU precision: bf16 autocast over fp32 master weights
(trainer.precision=auto on CUDA, or bf16 anywhere). Run here with CPU autocast, which takes the same code paths:
before the fix, MTP's MoE block and every drafter's chunked loss failed in backward with a bf16 x fp32 matmul
(first seen on an H200 by bench/drafter_steps.py)."""

import pytest
import torch

from specdistill.core.batch import PackedBatch
from specdistill.core.target import TargetHead
from tests.drafters.batches import small_drafter


def _batch(info, layer_ids, lengths=(40, 36), response=(12, 10)):
    g = torch.Generator().manual_seed(0)
    T = sum(lengths)
    return PackedBatch(torch.randint(0, info.vocab_size, (T,), generator=g),
                       torch.cat([torch.arange(n) >= n - r for n, r in zip(lengths, response)]),
                       torch.randn(T, len(layer_ids), info.hidden_size, generator=g),
                       torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)),
                       torch.cat([torch.arange(n) for n in lengths]), tuple(layer_ids), tuple(range(len(lengths))))


def _step(drafter, head, batch, autocast: bool):
    drafter.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = drafter(batch, head, torch.Generator().manual_seed(0))
    out.loss.backward()
    return float(out.loss), {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", ["mtp", "eagle3", "dflash", "dspark", "dflash2"])
def test_training_step_under_bf16_autocast_matches_fp32(tiny_llama_dir, tmp_path, name):
    torch.manual_seed(0)
    info, drafter = small_drafter(name, tiny_llama_dir, tmp_path)
    drafter.train()
    head = TargetHead(info)
    batch = _batch(info, drafter.feature_spec().layer_ids)
    loss32, grads32 = _step(drafter, head, batch, autocast=False)
    loss16, grads16 = _step(drafter, head, batch, autocast=True)
    assert abs(loss16 - loss32) <= 0.05 * abs(loss32), (loss16, loss32)
    assert grads16.keys() == grads32.keys() and grads32
    for key, g32 in grads32.items():
        g16 = grads16[key]
        assert g16.dtype == torch.float32 and torch.isfinite(g16).all(), key
        if g32.abs().max() > 0:  # bf16 rounding of every GEMM: the gradient's direction, not its last bits
            assert torch.cosine_similarity(g16.flatten(), g32.flatten(), dim=0) > 0.95, key
