"""Padding that gives compiled attention a few fixed shapes, invisible to the caller (specdistill/core/shapes.py).

Anchor blocks: the plan is built over `bucket` anchors, the real ones followed by padding anchors at position 0,
which see no context (keys before position 0) and only their own block. Queries and the block part of the keys and
values (which follows the T context keys) are padded with zeros. A real query never sees a padded key (each block
sees only its own block and its context) and the outputs of padded queries are dropped, so their gradient is zero:
outputs and gradients are the unpadded plan's (tests/kernels/test_attention.py).

Packed causal (EAGLE-3's pairs): the sequence is padded to `length` with one more document, which no real position
attends to.

A compacted context (DFlash's compute='read' keeps only the positions some window reaches): the plan is built over the
context padded to the run's token budget with one more document, and zero keys and values fill that padding.
"""

import torch
import torch.nn.functional as F


def pad_anchors(anchors_N: torch.Tensor, bucket: int) -> torch.Tensor:
    """[bucket] anchors: anchors_N, then zeros (position 0: no context)."""
    return F.pad(anchors_N, (0, bucket - anchors_N.shape[0]))


def pad_documents(document_ids_T: torch.Tensor, length: int) -> torch.Tensor:
    """[length] document ids: document_ids_T, then one padding document after the last one."""
    pad_id = int(document_ids_T.max()) + 1 if document_ids_T.numel() else 0
    return F.pad(document_ids_T, (0, length - document_ids_T.shape[0]), value=pad_id)


class PaddedQueries:
    """A plan built for `padded` queries (and as many more keys, at the end of the key sequence) called with
    `real` ones: q, k and v are padded with zeros at the end, and the output is cut back to the real queries."""

    def __init__(self, inner, real: int, padded: int):
        self.inner, self.real, self.padded = inner, real, padded

    def __call__(self, q_HQd, k_HKd, v_HKd, scale: float) -> torch.Tensor:
        pad = (0, 0, 0, self.padded - self.real)  # dim 1 (queries / keys) of [H, Q, d]
        return self.inner(F.pad(q_HQd, pad), F.pad(k_HKd, pad), F.pad(v_HKd, pad), scale)[: self.real]


class PaddedContext:
    """A plan built over `padded` context keys (the real ones, then a padding document no anchor belongs to) called
    with `real` ones: zero keys and values are inserted after the real context, before the block keys. So a caller
    that projects K/V only at the context positions it kept (DFlash's compute='read') gives a compiled kernel the
    run's fixed context length; a padded key is in no anchor's document, so no query sees it."""

    def __init__(self, inner, real: int, padded: int):
        self.inner, self.real, self.padded = inner, real, padded

    def __call__(self, q_HQd, k_HKd, v_HKd, scale: float) -> torch.Tensor:
        def widen(x_HKd):
            gap = x_HKd.new_zeros(x_HKd.shape[0], self.padded - self.real, x_HKd.shape[2])
            return torch.cat([x_HKd[:, :self.real], gap, x_HKd[:, self.real:]], dim=1)

        return self.inner(q_HQd, widen(k_HKd), widen(v_HKd), scale)
