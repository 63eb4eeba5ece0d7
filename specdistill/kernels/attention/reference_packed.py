"""Exact reference for causal attention over a packed sequence (EAGLE-3 / MTP-style drafters).

Queries = keys = the T packed tokens. Query i sees key j when both lie in the same document, j <= i, and,
with a sliding window W, i - j < W (W keys including itself: transformers' `sliding_window` convention,
`kv_idx > q_idx - W`). Attention itself is `reference.masked_attention` with this mask.
"""

import torch


def packed_causal_mask(document_ids_T: torch.Tensor, sliding_window: int | None = None) -> torch.Tensor:
    """Boolean mask [T, T], True where attention is allowed."""
    pos = torch.arange(document_ids_T.shape[0], device=document_ids_T.device)
    mask = (document_ids_T[:, None] == document_ids_T[None, :]) & (pos[None, :] <= pos[:, None])
    if sliding_window is not None:
        mask &= pos[None, :] > pos[:, None] - sliding_window
    return mask
