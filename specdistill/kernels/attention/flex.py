"""CUDA path: torch flex_attention (compiled) with block masks whose mask_mod equals the reference masks.

`create_block_mask` evaluates the mask_mod per 128x128 tile and lets the kernel skip empty tiles, which is
where the speed comes from: an anchor block's row has ~W + B live keys out of T + N*B. On CPU flex_attention
has no backward; its forward (eager) is used only to test the mask_mods against the references.
"""

import functools

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention


@functools.cache
def _compiled_flex():
    return torch.compile(flex_attention, dynamic=False)


def anchor_block_mask_mod(document_ids_T, anchors_N, block_size: int, sliding_window=None, causal_in_block=False):
    """mask_mod(b, h, q_idx, kv_idx) equal to `reference.anchor_block_mask`."""
    T, B = document_ids_T.shape[0], block_size

    def mask_mod(b, h, q_idx, kv_idx):
        anchor = anchors_N[q_idx // B]
        kv_ctx = torch.clamp(kv_idx, max=T - 1)  # keep the gather in bounds for block keys
        ctx = (kv_idx < T) & (kv_ctx < anchor) & (document_ids_T[kv_ctx] == document_ids_T[anchor])
        if sliding_window is not None:
            ctx = ctx & (kv_ctx >= anchor - sliding_window)
        kv_blk = kv_idx - T
        blk = (kv_idx >= T) & (kv_blk // B == q_idx // B)
        if causal_in_block:
            blk = blk & (kv_blk <= q_idx)
        return ctx | blk

    return mask_mod


def packed_causal_mask_mod(document_ids_T, sliding_window=None):
    """mask_mod equal to `reference_packed.packed_causal_mask`."""

    def mask_mod(b, h, q_idx, kv_idx):
        ok = (document_ids_T[q_idx] == document_ids_T[kv_idx]) & (kv_idx <= q_idx)
        if sliding_window is not None:
            ok = ok & (kv_idx > q_idx - sliding_window)
        return ok

    return mask_mod


class FlexPlan:
    """A BlockMask built once per batch; calling it runs flex_attention (compiled on CUDA)."""

    def __init__(self, mask_mod, q_len: int, kv_len: int, device: torch.device, compile: bool | None = None):
        self.compile = device.type == "cuda" if compile is None else compile
        self.block_mask: BlockMask = create_block_mask(mask_mod, None, None, q_len, kv_len, device=device,
                                                       _compile=self.compile)

    def __call__(self, q_HQd, k_HKd, v_HKd, scale: float) -> torch.Tensor:
        attend = _compiled_flex() if self.compile else flex_attention
        out = attend(q_HQd[None], k_HKd[None], v_HKd[None], block_mask=self.block_mask, scale=scale,
                     enable_gqa=q_HQd.shape[0] != k_HKd.shape[0])
        return out[0].transpose(0, 1)
