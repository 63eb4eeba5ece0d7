"""Attention over packed sequences: exact references and the fast path chosen per device.

Build a plan once per batch (the mask, or the chunking, is shared by every layer), call it per layer:

    plan = anchor_block_plan(document_ids_T, anchors_N, B, sliding_window, causal_in_block)
    out_QHd = plan(q_HQd, k_HKd, v_HKd, scale)

impl: "auto" (CUDA -> compiled flex_attention, else chunked SDPA), "flex", "chunked", "reference".

static: the run's few fixed shapes (specdistill/core/shapes.py StaticShapes, passed through from the pack): the plans
pad their query blocks (anchors to a bucket, EAGLE-3's pairs to the pack length) so that a compiled kernel sees only
those shapes, and record each shape they give it. The padding is invisible to the caller: real queries never see a
padded key, and the outputs of padded queries are dropped (static.py).
"""

import torch

from specdistill.kernels.attention.chunked import ChunkPlan, documents_are_contiguous
from specdistill.kernels.attention import chunked, flex
from specdistill.kernels.attention.reference import anchor_block_mask, masked_attention
from specdistill.kernels.attention.reference_packed import packed_causal_mask
from specdistill.kernels.attention.static import PaddedQueries, pad_anchors, pad_documents

IMPLS = ("auto", "flex", "chunked", "reference")


class ReferencePlan:
    """The dense boolean mask + SDPA (`reference.masked_attention`)."""

    def __init__(self, mask_QK: torch.Tensor):
        self.mask_QK = mask_QK

    def __call__(self, q_HQd, k_HKd, v_HKd, scale: float) -> torch.Tensor:
        return masked_attention(q_HQd, k_HKd, v_HKd, self.mask_QK, scale)


def _resolve(impl: str, document_ids_T: torch.Tensor) -> str:
    if impl not in IMPLS:
        raise ValueError(f"attention impl {impl!r} is not one of {IMPLS}")
    contiguous = documents_are_contiguous(document_ids_T)
    if impl == "chunked" and not contiguous:
        raise ValueError("impl='chunked' needs each document id in one contiguous run of document_ids_T; "
                         "use impl='reference' (or 'auto') for interleaved ids")
    if impl != "auto":
        return impl
    if document_ids_T.device.type == "cuda":
        return "flex"
    return "chunked" if contiguous else "reference"


def anchor_block_plan(document_ids_T, anchors_N, block_size: int, sliding_window: int | None = None,
                      causal_in_block: bool = False, impl: str = "auto", static=None):
    """Plan for DFlash-family attention: queries = N blocks of B, keys = [context T ; blocks N*B]."""
    if static is not None:
        T, N, bucket = document_ids_T.shape[0], anchors_N.shape[0], static.anchors(anchors_N.shape[0])
        # Recorded: the shapes compiled. Unpadded on CUDA, every pack's own; on CPU, those padding would give.
        own = not static.pad and document_ids_T.is_cuda
        Q = (N if own else bucket) * block_size
        static.record("anchor_block", Q, (T if static.pad or own else static.tokens) + Q, block_size,
                      sliding_window, causal_in_block)
        static.count_queries(N * block_size, Q)
        if static.pad:
            inner = anchor_block_plan(document_ids_T, pad_anchors(anchors_N, bucket), block_size, sliding_window,
                                      causal_in_block, impl)
            return PaddedQueries(inner, N * block_size, bucket * block_size)
    impl = _resolve(impl, document_ids_T)
    if impl == "reference":
        return ReferencePlan(anchor_block_mask(document_ids_T, anchors_N, block_size, sliding_window, causal_in_block))
    if impl == "chunked":
        return chunked.anchor_block_plan(document_ids_T, anchors_N, block_size, sliding_window, causal_in_block)
    T, Q = document_ids_T.shape[0], anchors_N.shape[0] * block_size
    mod = flex.anchor_block_mask_mod(document_ids_T, anchors_N, block_size, sliding_window, causal_in_block)
    return flex.FlexPlan(mod, Q, T + Q, document_ids_T.device)


def packed_causal_plan(document_ids_T, sliding_window: int | None = None, impl: str = "auto", static=None):
    """Plan for causal attention inside each packed document (EAGLE-3's pairs): queries = keys = T tokens (with
    `static`, padded to static.tokens)."""
    if static is not None:
        T = document_ids_T.shape[0]
        if static.pad and T > static.tokens:
            raise ValueError(f"packed causal attention over {T} positions, more than the run's fixed "
                             f"{static.tokens} (trainer.token_budget)")
        size = T if not static.pad and document_ids_T.is_cuda else static.tokens  # as anchor_block_plan records
        static.record("packed_causal", size, size, sliding_window)
        if static.pad and T < static.tokens:
            inner = packed_causal_plan(pad_documents(document_ids_T, static.tokens), sliding_window, impl)
            return PaddedQueries(inner, T, static.tokens)
    impl = _resolve(impl, document_ids_T)
    if impl == "reference":
        return ReferencePlan(packed_causal_mask(document_ids_T, sliding_window))
    if impl == "chunked":
        return chunked.packed_causal_plan(document_ids_T, sliding_window)
    T = document_ids_T.shape[0]
    return flex.FlexPlan(flex.packed_causal_mask_mod(document_ids_T, sliding_window), T, T, document_ids_T.device)


def anchor_block_attention(q_HQd, k_HKd, v_HKd, document_ids_T, anchors_N, block_size: int, scale: float,
                           sliding_window: int | None = None, causal_in_block: bool = False, impl: str = "auto"):
    """One-shot form of `anchor_block_plan(...)(q, k, v, scale)` -> [N*B, H, d]."""
    plan = anchor_block_plan(document_ids_T, anchors_N, block_size, sliding_window, causal_in_block, impl)
    return plan(q_HQd, k_HKd, v_HKd, scale)


def packed_causal_attention(q_HTd, k_HTd, v_HTd, document_ids_T, scale: float,
                            sliding_window: int | None = None, impl: str = "auto"):
    """One-shot form of `packed_causal_plan(...)(q, k, v, scale)` -> [T, H, d]."""
    return packed_causal_plan(document_ids_T, sliding_window, impl)(q_HTd, k_HTd, v_HTd, scale)


__all__ = [
    "IMPLS", "ChunkPlan", "ReferencePlan", "anchor_block_attention", "anchor_block_mask", "anchor_block_plan",
    "masked_attention", "packed_causal_attention", "packed_causal_mask", "packed_causal_plan",
]
