"""CUDA path: torch flex_attention (compiled) with block masks whose mask_mod equals the reference masks.

`create_block_mask` evaluates the mask_mod per 128x128 tile and lets the kernel skip empty tiles, which is
where the speed comes from: an anchor block's row has ~W + B live keys out of T + N*B. On CPU flex_attention
has no backward; its forward (eager) is used only to test the mask_mods against the references.

Both compiled functions are compiled with fullgraph=True: past torch's recompile limits (torch._dynamo.config
recompile_limit, accumulated_recompile_limit; the trainer raises both per drafter) dynamo then raises instead of
running the call uncompiled, where flex_attention materialises [heads, queries, keys] scores (~20 GB per layer at 8k
queries x 41k keys). FlexPlan turns that into RecompileLimitHit, naming the shape. `compiled_graphs()` counts the
graphs dynamo really compiled (metrics.json `compiled_graphs`, beside the plans' own count, `compiled_shapes`).
"""

import functools

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

# torch._dynamo is imported where something is compiled (torch.compile imports it): importing it costs seconds, which
# every process importing the drafters would pay.


@functools.cache
def _compiled_flex():
    return torch.compile(flex_attention, dynamic=False, fullgraph=True)


@functools.cache
def _compiled_block_mask():
    # What create_block_mask(_compile=True) did (automatic dynamic shapes), with fullgraph's hard limit.
    return torch.compile(create_block_mask, fullgraph=True)


def compiled_graphs() -> dict[str, int]:
    """Graphs dynamo compiled for attention in this process: one per cache entry of each compiled function's code
    (a new entry is a new graph; the limits count the same entries). Functions traced inside a bigger compiled graph
    (trainer.compile=true) are counted there, not here."""
    functions = {"flex_attention": flex_attention, "create_block_mask": create_block_mask}
    if not (_compiled_flex.cache_info().currsize or _compiled_block_mask.cache_info().currsize):
        return dict.fromkeys(functions, 0)  # nothing compiled here
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    return {name: len(_debug_get_cache_entry_list(fn.__code__)) for name, fn in functions.items()}


class RecompileLimitHit(RuntimeError):
    """A compiled attention function would need one more graph than torch's recompile limits allow."""


def _run_compiled(fn, what: str, *args, **kwargs):
    from torch._dynamo import config
    from torch._dynamo.exc import FailOnRecompileLimitHit

    try:
        return fn(*args, **kwargs)
    except FailOnRecompileLimitHit as err:
        raise RecompileLimitHit(
            f"compiled {what} needs a new graph past torch's recompile limit (recompile_limit="
            f"{config.recompile_limit}, accumulated_recompile_limit={config.accumulated_recompile_limit}; graphs so "
            f"far: {compiled_graphs()}); uncompiled it would materialise [heads, queries, keys] scores. The run's "
            f"attention shapes are not fixed: keep trainer.pad_packs=true (the default on CUDA), or raise both limits "
            f"in torch._dynamo.config (docs/scaling.md, \"Compiled shapes\")") from err


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
        self.shape = f"{q_len} queries x {kv_len} keys"
        if self.compile:
            self.block_mask: BlockMask = _run_compiled(_compiled_block_mask(), f"create_block_mask ({self.shape})",
                                                       mask_mod, None, None, q_len, kv_len, device=device)
        else:
            self.block_mask = create_block_mask(mask_mod, None, None, q_len, kv_len, device=device)

    def __call__(self, q_HQd, k_HKd, v_HKd, scale: float) -> torch.Tensor:
        args = (q_HQd[None], k_HKd[None], v_HKd[None])
        kwargs = dict(block_mask=self.block_mask, scale=scale, enable_gqa=q_HQd.shape[0] != k_HKd.shape[0])
        if self.compile:
            out = _run_compiled(_compiled_flex(), f"flex_attention ({self.shape})", *args, **kwargs)
        else:
            out = flex_attention(*args, **kwargs)
        return out[0].transpose(0, 1)
