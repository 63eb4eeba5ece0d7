"""Exact chunked attention for packed masks, for devices where flex_attention has no backward (CPU).

The dense reference attends every query to all T + N*B keys through a boolean mask. Its structure is
sparse and contiguous: an anchor block sees one contiguous context range of its own document
[max(doc_start, anchor - W), anchor) plus its own B tokens; a causal query sees its document's prefix.
A `ChunkPlan` groups consecutive queries into segments, each with the few key ranges it can see and a
small mask (or plain `is_causal`), and runs one SDPA per segment. Masked entries contribute exactly 0
after softmax in both paths, so the result equals the reference up to float summation order.

Per layer the keys of all segments are gathered once (`index_select`: one scatter-add in backward) and
split per segment (backward: one cat), so autograd never materialises a full-size zero gradient per chunk.

Suffixes: H heads, Q queries, K keys, d head dim, T packed tokens, N anchors, B block size, S segments.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specdistill.kernels.attention.reference_packed import packed_causal_mask

# A segment's cost in (query x key) products, plus a fixed per-SDPA-call overhead in the same units.
# Tuned by hand on 2 busy CPU cores (8192 / 512 beat 2^17 / 1024 and 2^19 / 2048 at 16k; noisy, not a fit).
CALL_COST = 8192
MAX_SEGMENT_QUERIES = 512


@dataclass
class Segment:
    q_start: int
    q_end: int
    key_ranges: list[tuple[int, int]]  # [start, end) into the key sequence, concatenated in order
    mask_QK: torch.Tensor | None  # None: plain causal (queries and keys are the same positions)


class ChunkPlan:
    """Segments covering all queries in order; built once per batch, reused by every layer."""

    def __init__(self, segments: list[Segment], device: torch.device):
        self.segments = segments
        self.q_sizes = [s.q_end - s.q_start for s in segments]
        self.k_sizes = [sum(e - b for b, e in s.key_ranges) for s in segments]
        ranges = [torch.arange(b, e) for s in segments for b, e in s.key_ranges]
        self.key_index = torch.cat(ranges).to(device) if ranges else torch.zeros(0, dtype=torch.long, device=device)

    def __call__(self, q_HQd: torch.Tensor, k_HKd: torch.Tensor, v_HKd: torch.Tensor, scale: float) -> torch.Tensor:
        """Attention output [Q, H, d], as `reference.masked_attention`."""
        gqa = q_HQd.shape[0] != k_HKd.shape[0]
        qs = q_HQd.split(self.q_sizes, dim=1)
        ks = k_HKd.index_select(1, self.key_index).split(self.k_sizes, dim=1)
        vs = v_HKd.index_select(1, self.key_index).split(self.k_sizes, dim=1)
        outs = [
            F.scaled_dot_product_attention(
                q[None], k[None], v[None], attn_mask=seg.mask_QK, is_causal=seg.mask_QK is None,
                scale=scale, enable_gqa=gqa,
            )
            for seg, q, k, v in zip(self.segments, qs, ks, vs)
        ]
        return torch.cat(outs, dim=2)[0].transpose(0, 1)


def document_starts(document_ids_T: torch.Tensor) -> torch.Tensor:
    """Index of the first token of each token's document run [T]; documents must be contiguous runs."""
    T = document_ids_T.shape[0]
    pos = torch.arange(T, device=document_ids_T.device)
    new_run = torch.ones(T, dtype=torch.bool, device=document_ids_T.device)
    new_run[1:] = document_ids_T[1:] != document_ids_T[:-1]
    return torch.cummax(torch.where(new_run, pos, 0), dim=0).values


def documents_are_contiguous(document_ids_T: torch.Tensor) -> bool:
    """True when every document id occupies one contiguous run (as packing produces)."""
    return torch.unique_consecutive(document_ids_T).numel() == torch.unique(document_ids_T).numel()


def _cost(num_queries: int, num_keys: int) -> int:
    return num_queries * num_keys + CALL_COST


def anchor_block_plan(
    document_ids_T: torch.Tensor, anchors_N: torch.Tensor, block_size: int,
    sliding_window: int | None = None, causal_in_block: bool = False,
) -> ChunkPlan:
    """Plan for `reference.anchor_block_mask`: keys are [context (T) ; blocks (N*B)]."""
    T, B = document_ids_T.shape[0], block_size
    lo_N = document_starts(document_ids_T)[anchors_N]
    if sliding_window is not None:
        lo_N = torch.maximum(lo_N, anchors_N - sliding_window)
    lo, hi = lo_N.clamp(max=T).tolist(), anchors_N.tolist()
    lo = [min(a, b) for a, b in zip(lo, hi)]  # an anchor at its document's start sees no context

    # Greedy: grow a run of consecutive blocks while one SDPA over the union is cheaper than two calls.
    groups, start = [], 0
    for n in range(1, len(hi) + 1):
        if n < len(hi):
            nb = n - start
            u_lo, u_hi = min(lo[start:n]), max(hi[start:n])
            m_lo, m_hi = min(u_lo, lo[n]), max(u_hi, hi[n])
            merged = _cost((nb + 1) * B, (m_hi - m_lo) + (nb + 1) * B)
            apart = _cost(nb * B, (u_hi - u_lo) + nb * B) + _cost(B, hi[n] - lo[n] + B)
            if merged <= apart and (nb + 1) * B <= MAX_SEGMENT_QUERIES:
                continue
        groups.append((start, n))
        start = n

    block_Q = torch.arange(MAX_SEGMENT_QUERIES, device=document_ids_T.device) // B
    segments = []
    for n0, n1 in groups:
        u_lo, u_hi, nq = min(lo[n0:n1]), max(hi[n0:n1]), (n1 - n0) * B
        ctx_pos = torch.arange(u_lo, u_hi, device=document_ids_T.device)
        lo_Q = lo_N[n0:n1].repeat_interleave(B)
        hi_Q = anchors_N[n0:n1].repeat_interleave(B)
        ctx = (ctx_pos[None, :] >= lo_Q[:, None]) & (ctx_pos[None, :] < hi_Q[:, None])
        blk = block_Q[:nq, None] == block_Q[None, :nq]
        if causal_in_block:
            blk = blk.tril()
        segments.append(Segment(n0 * B, n1 * B, [(u_lo, u_hi), (T + n0 * B, T + n1 * B)], torch.cat([ctx, blk], 1)))
    return ChunkPlan(segments, document_ids_T.device)


def packed_causal_plan(document_ids_T: torch.Tensor, sliding_window: int | None = None) -> ChunkPlan:
    """Plan for `reference_packed.packed_causal_mask`: queries = keys = the packed sequence."""
    device, T = document_ids_T.device, document_ids_T.shape[0]
    starts = torch.nonzero(document_starts(document_ids_T) == torch.arange(T, device=device)).squeeze(-1).tolist()
    docs = list(zip(starts, starts[1:] + [T]))
    W = sliding_window
    segments, small = [], []  # `small`: consecutive short documents waiting to share one masked SDPA

    def flush_small():
        if small:
            s0, s1 = small[0][0], small[-1][1]
            segments.append(Segment(s0, s1, [(s0, s1)], packed_causal_mask(document_ids_T[s0:s1], W)))
            small.clear()

    for s, e in docs:
        L = e - s
        if small and e - small[0][0] > MAX_SEGMENT_QUERIES // 2:
            flush_small()
        if L <= MAX_SEGMENT_QUERIES // 4:
            small.append((s, e))
            continue
        flush_small()
        if W is None or W >= L:
            segments.append(Segment(s, e, [(s, e)], None))
            continue
        for q0 in range(s, e, MAX_SEGMENT_QUERIES):  # windowed long document: query chunks, keys cut to the window
            q1, k0 = min(q0 + MAX_SEGMENT_QUERIES, e), max(s, q0 - W + 1)
            q_pos = torch.arange(q0, q1, device=device)[:, None]
            k_pos = torch.arange(k0, q1, device=device)[None, :]
            segments.append(Segment(q0, q1, [(k0, q1)], (k_pos <= q_pos) & (k_pos > q_pos - W)))
    flush_small()
    return ChunkPlan(segments, device)

