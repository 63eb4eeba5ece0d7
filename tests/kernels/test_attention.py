"""Attention paths agree with the dense-mask references (values and gradients) on random packed inputs."""

import pytest
import torch

from specdistill.kernels.attention import (anchor_block_mask, anchor_block_plan, packed_causal_mask, packed_causal_plan)
from specdistill.kernels.attention.chunked import document_starts
from specdistill.kernels.attention.flex import FlexPlan, anchor_block_mask_mod, packed_causal_mask_mod

# fp32 on CPU: both paths are exact softmax attention; only the summation order differs (~1e-6).
ATOL, RTOL = 2e-5, 1e-4
H, H_KV, D_HEAD = 4, 2, 16


def packed_docs(lengths):
    return torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])


def random_case(seed, T):
    g = torch.Generator().manual_seed(seed)
    lengths = []
    while sum(lengths) < T:
        lengths.append(int(torch.randint(1, 40, (1,), generator=g)))
    lengths[-1] -= sum(lengths) - T
    lengths.insert(int(torch.randint(0, len(lengths), (1,), generator=g)), 1)  # a document of length 1
    doc = packed_docs([n for n in lengths if n > 0])
    N = int(torch.randint(1, 24, (1,), generator=g))
    anchors = torch.randperm(doc.numel(), generator=g)[:N].sort().values
    return doc, anchors


def grads(plan, q, k, v, g):
    out = plan(q, k, v, D_HEAD**-0.5)
    return [out, *torch.autograd.grad(out, (q, k, v), g)]


def qkv(Q, K, seed=0):
    g = torch.Generator().manual_seed(seed)
    make = lambda h, n: torch.randn(h, n, D_HEAD, generator=g, requires_grad=True)  # noqa: E731
    return make(H, Q), make(H_KV, K), make(H_KV, K), torch.randn(Q, H, D_HEAD, generator=g)


def assert_paths_agree(ref_plan, fast_plan, Q, K):
    q, k, v, g = qkv(Q, K)
    for name, a, b in zip(("out", "dq", "dk", "dv"), grads(ref_plan, q, k, v, g), grads(fast_plan, q, k, v, g)):
        torch.testing.assert_close(b, a, atol=ATOL, rtol=RTOL, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("window,causal", [(None, False), (7, True), (10_000, False), (1, False)])
def test_anchor_block_chunked_equals_reference(seed, window, causal):
    doc, anchors = random_case(seed, T=160)
    B = 4
    plans = [anchor_block_plan(doc, anchors, B, window, causal, impl=i) for i in ("reference", "chunked")]
    Q = anchors.numel() * B
    assert_paths_agree(*plans, Q, doc.numel() + Q)


def test_anchor_edge_cases():
    # A length-1 document, an anchor at a document's first token (no context), one at a document's last token.
    doc = packed_docs([5, 1, 9, 3])
    anchors = torch.tensor([0, 4, 5, 6, 14, 15, 17])
    for window in (None, 2, 100):
        plans = [anchor_block_plan(doc, anchors, 3, window, impl=i) for i in ("reference", "chunked")]
        assert_paths_agree(*plans, 21, doc.numel() + 21)


def test_anchor_many_blocks_span_segments():
    """Enough blocks that the planner splits them into several SDPA segments."""
    doc = packed_docs([300, 200, 500])
    anchors = torch.arange(100, 1000, 7)
    fast = anchor_block_plan(doc, anchors, 8, 64, impl="chunked")
    assert len(fast.segments) > 1
    ref = anchor_block_plan(doc, anchors, 8, 64, impl="reference")
    Q = anchors.numel() * 8
    assert_paths_agree(ref, fast, Q, doc.numel() + Q)


@pytest.mark.parametrize("window", [None, 1, 5, 100_000])
def test_packed_causal_chunked_equals_reference(window):
    doc = packed_docs([1, 3, 200, 1, 40, 300, 2])  # short docs share a segment; long ones are split by window
    plans = [packed_causal_plan(doc, window, impl=i) for i in ("reference", "chunked")]
    assert_paths_agree(*plans, doc.numel(), doc.numel())


def test_packed_causal_mask_semantics():
    doc = packed_docs([2, 3])
    m = packed_causal_mask(doc, sliding_window=2)
    assert m[1].tolist() == [True, True, False, False, False]
    assert m[4].tolist() == [False, False, False, True, True]  # window 2: itself and one before
    assert not m[2, 1]  # never across documents


def test_document_starts():
    assert document_starts(packed_docs([2, 1, 3])).tolist() == [0, 0, 2, 3, 3, 3]


def test_interleaved_document_ids_fall_back_or_fail():
    doc = torch.tensor([0, 0, 1, 1, 0, 0])  # id 0 occurs twice: the chunked ranges would be wrong
    with pytest.raises(ValueError, match="contiguous"):
        anchor_block_plan(doc, torch.tensor([5]), 2, impl="chunked")
    auto = anchor_block_plan(doc, torch.tensor([5]), 2)
    assert torch.equal(auto.mask_QK, anchor_block_mask(doc, torch.tensor([5]), 2))


def test_unknown_impl_lists_choices():
    with pytest.raises(ValueError, match="auto"):
        anchor_block_plan(packed_docs([3]), torch.tensor([1]), 2, impl="fast")


@pytest.mark.parametrize("window,causal", [(None, False), (5, True)])
def test_flex_mask_mods_equal_reference_masks(window, causal):
    """The CUDA path's mask_mods, evaluated densely on CPU, are the reference masks."""
    doc, anchors = random_case(7, T=90)
    B, T = 3, doc.numel()
    Q = anchors.numel() * B
    q_idx, kv_idx = torch.arange(Q)[:, None], torch.arange(T + Q)[None, :]
    mod = anchor_block_mask_mod(doc, anchors, B, window, causal)
    assert torch.equal(mod(0, 0, q_idx, kv_idx), anchor_block_mask(doc, anchors, B, window, causal))
    t = torch.arange(T)
    assert torch.equal(packed_causal_mask_mod(doc, window)(0, 0, t[:, None], t[None, :]), packed_causal_mask(doc, window))


def test_flex_forward_on_cpu_equals_reference():
    """flex_attention has no CPU backward; its eager forward still checks the BlockMask plumbing."""
    doc, anchors = random_case(3, T=130)
    B, T = 4, doc.numel()
    Q = anchors.numel() * B
    flex = FlexPlan(anchor_block_mask_mod(doc, anchors, B, 16), Q, T + Q, doc.device, compile=False)
    ref = anchor_block_plan(doc, anchors, B, 16, impl="reference")
    q, k, v = (t.detach() for t in qkv(Q, T + Q)[:3])  # CPU flex rejects inputs that require grad
    with torch.no_grad():
        torch.testing.assert_close(flex(q, k, v, D_HEAD**-0.5), ref(q, k, v, D_HEAD**-0.5), atol=ATOL, rtol=RTOL)


def test_compiled_flex_counts_its_graphs_and_stops_at_the_recompile_limit():
    """Past torch's recompile limit a compiled call would run uncompiled (flex attention materialising [heads,
    queries, keys] scores): it stops with an error naming the call and its shape instead, and compiled_graphs()
    counts the graphs dynamo compiled. With a limit of 1, on CUDA where there is one (Triton), else on the CPU
    (inductor's C++ path, forward only)."""
    import torch._dynamo

    from specdistill.kernels.attention.flex import RecompileLimitHit, compiled_graphs

    device = "cuda" if torch.cuda.is_available() else "cpu"
    doc, anchors = (t.to(device) for t in random_case(3, T=130))
    B, T = 4, doc.numel()
    Q = anchors.numel() * B
    q, k, v = (t.detach().to(device) for t in qkv(Q, T + Q)[:3])
    torch._dynamo.reset()
    try:
        with torch._dynamo.config.patch(recompile_limit=1):
            with torch.no_grad():  # a held-out walk's call
                plan = FlexPlan(anchor_block_mask_mod(doc, anchors, B, 16), Q, T + Q, doc.device, compile=True)
                want = anchor_block_plan(doc, anchors, B, 16, impl="reference")(q, k, v, D_HEAD**-0.5)
                torch.testing.assert_close(plan(q, k, v, D_HEAD**-0.5), want, atol=ATOL, rtol=RTOL)
                assert compiled_graphs() == {"flex_attention": 1, "create_block_mask": 1}
                # Another pack length: its block mask would need a second graph.
                with pytest.raises(RecompileLimitHit, match=rf"create_block_mask \({Q} queries x {T - 2 + Q} keys\)"
                                                            r".*trainer.pad_packs"):
                    FlexPlan(anchor_block_mask_mod(doc[:-2], anchors, B, 16), Q, T - 2 + Q, doc.device, compile=True)
            # With autograd on (a training step's call) flex needs a graph of its own.
            with pytest.raises(RecompileLimitHit, match=rf"flex_attention \({Q} queries x {T + Q} keys\)"):
                plan(q, k, v, D_HEAD**-0.5)
        assert compiled_graphs() == {"flex_attention": 1, "create_block_mask": 1}
    finally:
        torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled flex_attention backward needs a CUDA device")
@pytest.mark.parametrize("window,causal", [(None, False), (64, True)])
def test_flex_cuda_equals_reference(window, causal):
    torch.manual_seed(0)
    doc = packed_docs([1, 300, 17, 700, 1]).cuda()
    anchors = torch.tensor([0, 5, 300, 301, 317, 600, 1017, 1018]).cuda()
    B = 8
    Q, K = anchors.numel() * B, doc.numel() + anchors.numel() * B
    q, k, v = (torch.randn(h, n, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for h, n in ((H, Q), (H_KV, K), (H_KV, K)))
    g = torch.randn(Q, H, 64, device="cuda", dtype=torch.bfloat16)
    outs = []
    for impl in ("reference", "flex"):
        plan = anchor_block_plan(doc, anchors, B, window, causal, impl=impl)
        out = plan(q, k, v, 0.125)
        outs.append([out, *torch.autograd.grad(out, (q, k, v), g)])
    for a, b in zip(*outs):  # bf16 kernels with different tiling: ~1e-2 absolute on O(1) values
        torch.testing.assert_close(b.float(), a.float(), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("impl", ["reference", "chunked"])
@pytest.mark.parametrize("seed", range(2))
def test_padded_plans_equal_the_unpadded_reference(impl, seed):
    """core/shapes.py's fixed shapes: an anchor-block plan padded to its anchor bucket, and a packed-causal plan
    padded to the pack length, give the unpadded reference's outputs and gradients (kernels/attention/static.py)."""
    from specdistill.core.shapes import StaticShapes

    doc, anchors = random_case(seed, T=160)
    B, static = 4, StaticShapes(tokens=192, pad=True)
    Q = anchors.numel() * B
    padded = anchor_block_plan(doc, anchors, B, 7, True, impl=impl, static=static)
    assert padded.padded == static.anchors(anchors.numel()) * B > Q
    assert_paths_agree(anchor_block_plan(doc, anchors, B, 7, True, impl="reference"), padded, Q, doc.numel() + Q)
    causal = packed_causal_plan(doc, 5, impl=impl, static=static)
    assert causal.padded == 192
    assert_paths_agree(packed_causal_plan(doc, 5, impl="reference"), causal, doc.numel(), doc.numel())
    assert len(static.seen) == 2


def test_padded_flex_plan_forward_equals_the_reference():
    """The flex mask_mods over padded anchors (position 0: no context) and a padding document (eager forward on CPU;
    CUDA runs the same mask compiled)."""
    from specdistill.core.shapes import StaticShapes

    doc, anchors = random_case(1, T=160)
    B, static = 4, StaticShapes(tokens=192, pad=True)
    Q = anchors.numel() * B
    q, k, v = (t.detach() for t in qkv(Q, doc.numel() + Q)[:3])
    want = anchor_block_plan(doc, anchors, B, None, False, impl="reference")(q, k, v, D_HEAD**-0.5)
    got = anchor_block_plan(doc, anchors, B, None, False, impl="flex", static=static)(q, k, v, D_HEAD**-0.5)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
    q, k, v = (t.detach() for t in qkv(doc.numel(), doc.numel())[:3])
    want = packed_causal_plan(doc, None, impl="reference")(q, k, v, D_HEAD**-0.5)
    got = packed_causal_plan(doc, None, impl="flex", static=static)(q, k, v, D_HEAD**-0.5)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
