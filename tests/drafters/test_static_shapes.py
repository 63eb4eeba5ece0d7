"""A pack padded to the run's fixed shapes (specdistill/core/shapes.py: a padding document to trainer.token_budget,
query blocks padded to an anchor bucket, MTP's blocks to K slots, EAGLE-3's pairs to the pack length) trains exactly
as the unpadded pack: the same loss, metrics and gradients (fp32; rtol 1e-5, summation order only), for every
drafter. The padded run must also have padded something, and record only shapes over the fixed length."""

from dataclasses import replace

import pytest
import torch

from specdistill.core.batch import pack
from specdistill.core.shapes import StaticShapes
from specdistill.core.target import TargetHead
from tests.drafters.batches import make_samples, small_drafter, step_and_grads

PACK = 160  # the "token budget": two rows of 40 + 36 tokens leave 84 tokens of padding


@pytest.mark.parametrize("name", ["dflash", "dspark", "dflash2", "eagle3", "mtp"])
def test_a_padded_pack_trains_as_the_unpadded_one(tiny_llama_dir, tmp_path, name):
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
    out_padded, grads_padded = step_and_grads(drafter, head, padded)

    torch.testing.assert_close(out_padded.loss, out.loss, rtol=1e-5, atol=1e-6)
    assert torch.equal(out_padded.correct_K, out.correct_K) and torch.equal(out_padded.total_K, out.total_K)
    assert grads and grads_padded.keys() == grads.keys()
    for key, grad in grads.items():
        torch.testing.assert_close(grads_padded[key], grad, rtol=1e-5, atol=1e-7, msg=key)
    # What the compiled kernel would have seen: only the fixed pack length, and padded queries. A one-layer EAGLE-3
    # gives it nothing with compute='read': its layer's queries run at the chain anchors only (ChainAttention, SDPA).
    assert static.seen or (name == "eagle3" and drafter.compute == "read")
    assert all(PACK in key[1:3] or key[2] - key[1] == PACK for key in static.seen), static.seen
    if name != "eagle3":  # anchor-block plans: queries padded to a bucket
        assert static.query_pad_fraction > 0


def test_anchor_buckets_bound_the_shapes_and_the_waste():
    from specdistill.core.shapes import anchor_bucket

    buckets = sorted({anchor_bucket(n) for n in range(0, 1025)})
    assert buckets == [16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024]
    assert anchor_bucket(270) == 384  # the mission's ~270 response tokens do not pay for 1,024 anchors
    assert max(anchor_bucket(n) / n for n in range(16, 1025)) <= 1.5 + 1e-9
