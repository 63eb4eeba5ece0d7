"""Exact reference for DFlash-family attention over packed documents (dense boolean mask + SDPA).

Queries are N anchor blocks of B tokens; keys are [packed context (T) ; all blocks (N*B)].
A block sees (a) context tokens of its own document strictly before its anchor, within the sliding
window if one is set, and (b) its own block: bidirectional, or causal when asked. Never other blocks.
The window test matches speculators 0.9.0: context position >= anchor - window.
"""

import torch
import torch.nn.functional as F


def anchor_block_mask(
    document_ids_T: torch.Tensor,
    anchors_N: torch.Tensor,
    block_size: int,
    sliding_window: int | None = None,
    causal_in_block: bool = False,
) -> torch.Tensor:
    """Boolean mask [N*B, T + N*B], True where attention is allowed."""
    T, N, B = document_ids_T.shape[0], anchors_N.shape[0], block_size
    device = document_ids_T.device
    q_anchor = anchors_N.repeat_interleave(B)  # [N*B]
    ctx_pos = torch.arange(T, device=device)
    ctx = (document_ids_T[q_anchor][:, None] == document_ids_T[None, :]) & (ctx_pos[None, :] < q_anchor[:, None])
    if sliding_window is not None:
        ctx &= ctx_pos[None, :] >= (q_anchor[:, None] - sliding_window)
    q_block = torch.arange(N * B, device=device) // B
    blk = q_block[:, None] == q_block[None, :]
    if causal_in_block:
        q_idx = torch.arange(N * B, device=device)
        blk &= q_idx[None, :] <= q_idx[:, None]
    return torch.cat([ctx, blk], dim=1)


def masked_attention(
    q_HQd: torch.Tensor, k_HKd: torch.Tensor, v_HKd: torch.Tensor, mask_QK: torch.Tensor, scale: float
) -> torch.Tensor:
    """SDPA with a boolean mask; kv heads are shared by query-head groups (GQA). Returns [Q, H, d]."""
    out = F.scaled_dot_product_attention(
        q_HQd.unsqueeze(0), k_HKd.unsqueeze(0), v_HKd.unsqueeze(0),
        attn_mask=mask_QK, scale=scale, enable_gqa=q_HQd.shape[0] != k_HKd.shape[0],
    )
    return out.squeeze(0).transpose(0, 1)
