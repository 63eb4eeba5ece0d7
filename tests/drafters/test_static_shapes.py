"""A pack padded to the run's fixed shapes (specdistill/core/shapes.py: a padding document to trainer.token_budget,
query blocks padded to an anchor bucket, MTP's blocks to K slots, EAGLE-3's pairs to the pack length) trains exactly
as the unpadded pack: the same loss, metrics and gradients (fp32; rtol 1e-5, summation order only), for every
drafter. The padded run must also have padded something, its attention kernels must have seen only shapes over the
fixed length, and what it recorded (metrics.json compiled_shapes) must be the shapes they saw."""

from dataclasses import replace

import pytest
import torch

from specdistill.core.batch import pack
from specdistill.core.shapes import StaticShapes
from specdistill.core.target import TargetHead
from tests.drafters.batches import make_samples, small_drafter, step_and_grads

PACK = 160  # the "token budget": two rows of 40 + 36 tokens leave 84 tokens of padding


def _spy_on_attention_kernels(monkeypatch) -> set:
    """The (queries, keys) of every call into an attention kernel (the plans a compiled path would run), as the
    kernel received them: after any padding."""
    from specdistill.kernels.attention import ReferencePlan
    from specdistill.kernels.attention.chunked import ChunkPlan
    from specdistill.kernels.attention.flex import FlexPlan

    seen = set()
    for plan in (ReferencePlan, ChunkPlan, FlexPlan):
        def spied(self, q_HQd, k_HKd, v_HKd, scale, _call=plan.__call__):
            seen.add((q_HQd.shape[1], k_HKd.shape[1]))
            return _call(self, q_HQd, k_HKd, v_HKd, scale)

        monkeypatch.setattr(plan, "__call__", spied)
    return seen


@pytest.mark.parametrize("name", ["dflash", "dspark", "dflash2", "eagle3", "mtp"])
def test_a_padded_pack_trains_as_the_unpadded_one(tiny_llama_dir, tmp_path, name, monkeypatch):
    torch.manual_seed(0)
    info, drafter = small_drafter(name, tiny_llama_dir, tmp_path)
    drafter.train()
    head = TargetHead(info)
    layer_ids = drafter.feature_spec().layer_ids
    samples = make_samples(info, layer_ids)
    static = StaticShapes(tokens=PACK, pad=True)
    plain = pack(samples, layer_ids)
    padded = replace(pack(samples, layer_ids, pad_to=PACK), static=static)
    assert padded.num_tokens == PACK and padded.num_real_tokens == plain.num_tokens == 76

    out, grads = step_and_grads(drafter, head, plain)
    kernel_shapes = _spy_on_attention_kernels(monkeypatch)
    out_padded, grads_padded = step_and_grads(drafter, head, padded)

    torch.testing.assert_close(out_padded.loss, out.loss, rtol=1e-5, atol=1e-6)
    assert torch.equal(out_padded.correct_K, out.correct_K) and torch.equal(out_padded.total_K, out.total_K)
    assert grads and grads_padded.keys() == grads.keys()
    for key, grad in grads.items():
        torch.testing.assert_close(grads_padded[key], grad, rtol=1e-5, atol=1e-7, msg=key)
    # What the kernels saw: keys over the fixed pack length only (packed causal: PACK x PACK; anchor blocks: PACK
    # context keys + the padded blocks), and the shapes recorded are those. A one-layer EAGLE-3 gives them nothing
    # with compute='read': its layer's queries run at the chain anchors only (ChainAttention, SDPA).
    assert kernel_shapes or (name == "eagle3" and drafter.compute == "read")
    assert all(K == PACK or K - Q == PACK for Q, K in kernel_shapes), kernel_shapes
    assert {key[1:3] for key in static.seen} == kernel_shapes, (static.seen, kernel_shapes)
    if name != "eagle3":  # anchor-block plans: queries padded to a bucket
        assert static.query_pad_fraction > 0


def test_anchor_buckets_bound_the_shapes_and_the_waste():
    from specdistill.core.shapes import anchor_bucket

    buckets = sorted({anchor_bucket(n) for n in range(0, 1025)})
    assert buckets == [16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024]
    assert anchor_bucket(270) == 384  # the mission's ~270 response tokens do not pay for 1,024 anchors
    assert max(anchor_bucket(n) / n for n in range(16, 1025)) <= 1.5 + 1e-9


def test_a_padded_cuda_run_raises_both_of_torchs_recompile_limits_per_drafter():
    """Past either limit compiled attention stops the run (kernels/attention/flex.py): recompile_limit and the
    accumulated one (256 by default, below 5 drafters' planned shapes) both grow with the drafters."""
    import torch._dynamo

    from specdistill.trainer.trainer import COMPILED_SHAPES_LIMIT, _pad_packs

    config = torch._dynamo.config
    with config.patch(recompile_limit=8, accumulated_recompile_limit=256):
        assert _pad_packs(None, torch.device("cuda"), drafters=5)  # no CUDA call: the device names where it runs
        assert config.recompile_limit == config.accumulated_recompile_limit == 5 * COMPILED_SHAPES_LIMIT
