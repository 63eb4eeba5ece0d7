"""Analytic FLOPs of one drafter training step, for MFU: `python bench/step_flops.py [--drafters dflash,...]
[--packs 6x45,6x171,24x45] [--step-ms dflash=124.5,...]` prints a table of them at the production geometry
(bench/production_target.py PRODUCTION; drafters built on the meta device: counts only, no GPU, no weights).

    counts = pack_counts(drafter, batch, generator)   # what the step will do on this pack (real tokens only)
    flops = step_flops(drafter, counts)               # {"model": ..., "executed": ..., "parts": {...}, ...}
    mfu = flops["model"] / step_seconds / peak_flops_per_s

What is counted: every matmul of forward and backward (projections, MLPs, MoE experts at their top-k routing, fc
fusions, the vocabulary head on scored rows, the target's logits and argmax), and attention's two products (scores and
values: 4 H d FLOPs per query head per (query, key) pair in forward) over the pairs each query attends, as compiled
flex attention skips masked pairs (a flex tile of 128 x 128 that is partly masked is computed whole; that is not
counted: the count is the mask's). Not counted: norms, RoPE, softmax, activations, losses, gathers, embedding
lookups (O(rows x width), not O(rows x width^2)), and the optimizer (`optimizer_flops`, reported beside; a second
table splits it over `--ranks` as the trainer does, with its share of a rank's step at each `--grad-accum`).

Backward of a matmul: its dX when its input needs a gradient, its dW when its weight trains (each as much as the
forward); so 2x forward for a trainable layer inside the network, 1x for a trainable one reading target states (fc)
or a frozen one whose input needs a gradient (the target's lm_head as the draft vocabulary head), 0 for no-grad work
(target logits, argmax, top-k). Attention backward: 2x forward.

Two totals:
  model     forward + backward as above: the MFU numerator. A step that skips work (response-only logits,
            anchored blocks) is not credited for work it does not do.
  executed  model + overhead, where overhead is what the step computes beyond it: a chunked vocabulary loss over a
            trained weight recomputes its logits in backward (specdistill/kernels/logits/chunked.py; draft and
            target: DSpark's head, EAGLE-3's with train_lm_head; a frozen head forms its gradient in forward instead),
            DSpark's loss takes dW of the frozen lm_head rows it concatenates with the Markov head, MTP's step k
            recomputes the queries of steps 1..k-1 (specdistill/drafters/mtp.py chain_attention). On CPU
            FlopCounterMode sees this.
and, inside model, a lower bound on the work whose result no loss reads:
  unused    DFlash family: fc and K/V of context positions outside every anchor's window; EAGLE-3: step 0's last
            layer (q, o, MLP, attention) at the pairs that start no scored chain (only its K/V are read later).

Each count follows the drafter's `compute` (trainer.compute, specdistill/drafters/base.py): with 'read' the DFlash
family computes fc and K/V only at each document's [first window start, last anchor] (its unused: the few positions
there no window reaches), EAGLE-3 its last step-0 layer's q, o, MLP and attention only at the N chains (its unused:
none counted; the K/V of the pairs after a document's last chain are read by no query either), and DSpark, DFlash 2
and DFlash's KL form the target's logits once per distinct position (within targets.TARGET_LOGITS_BUDGET) instead
of per scored row and again in backward. `python bench/step_flops.py` prints both.

Counts come from real tokens only: a padded pack's padding document, padded anchors and padded MTP slots (the
compiled-shape padding, specdistill/core/shapes.py) do work that is not credited.

Suffixes: T tokens, N anchors, M scored rows, U distinct target positions, D hidden, V vocab.
"""

import argparse
import math
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.production_target import DENSE_BF16_PEAK_TFLOPS, MASK_TOKEN_ID, ROWS_PER_PACK, mission_pack  # noqa: E402
from specdistill.core.batch import PackedBatch  # noqa: E402
from specdistill.core.contract import FeatureSpec  # noqa: E402
from specdistill.kernels.attention.chunked import document_starts  # noqa: E402
from specdistill.drafters import DRAFTERS, drafter_config  # noqa: E402
from specdistill.drafters.base import COMPUTE_MODES  # noqa: E402
from specdistill.drafters.dflash import window_context  # noqa: E402
from specdistill.drafters.targets import TARGET_LOGITS_BUDGET  # noqa: E402
from specdistill.trainer.config import TrainerConfig  # noqa: E402
from specdistill.trainer.optim import (Optimizers, assign_owners, newton_schulz_flops,  # noqa: E402
                                        shard_rows)


@dataclass(frozen=True)
class PackCounts:
    """What one training step does on one pack, from its real tokens (padding excluded)."""

    tokens: int  # T: the rows' tokens
    documents: tuple[int, ...]  # the rows' lengths n_d (EAGLE-3's pairs: n_d - 1 per row)
    anchors: int  # N: blocks (DFlash family) or chains (MTP, EAGLE-3) trained
    context_keys: int  # C = sum_n c_n: the context keys one query of anchor n attends (window applied)
    context_read: int  # R: context positions (EAGLE-3: pairs) that some anchor's query attends
    context_kept: int  # DFlash family: the positions compute='read' gives fc and K/V (dflash.window_context); else T
    scored: tuple[int, ...]  # M_k: scored rows per draft slot / chain step (M = sum)
    targets: int  # U: distinct positions whose target token (or distribution) the rows learn

    @property
    def M(self) -> int:
        return sum(self.scored)


def _generator_copy(generator: torch.Generator | None) -> torch.Generator:
    """A generator in the state the step will see (the caller's is not advanced); seed 0 when none is given.
    The anchors depend on it only where a pack has more candidates than max_anchors."""
    copy = torch.Generator(device=generator.device if generator is not None else "cpu")
    if generator is None:
        return copy.manual_seed(0)
    copy.set_state(generator.get_state())
    return copy


def _documents(batch: PackedBatch) -> tuple[int, ...]:
    real = batch.num_real_tokens
    lengths = torch.bincount(batch.document_ids_T[:real].cpu())
    return tuple(int(n) for n in lengths[lengths > 0])


def _before_in_document(batch: PackedBatch, at_N: torch.Tensor) -> torch.Tensor:
    """Positions of each one's document laid out before it in the pack (not its position id: a row cut to what ships
    keeps its own positions, core/batch.py)."""
    return at_N - document_starts(batch.document_ids_T)[at_N]


def _covered(starts_N: torch.Tensor, ends_N: torch.Tensor, length: int) -> int:
    """Positions in the union of the intervals [start, end)."""
    delta = torch.zeros(length + 1, dtype=torch.long, device=starts_N.device)
    delta.index_add_(0, starts_N, torch.ones_like(starts_N)).index_add_(0, ends_N, -torch.ones_like(ends_N))
    return int((delta.cumsum(0)[:length] > 0).sum())


def _counts(batch, anchors_N, end_N, context_N, valid_NK, target_pos, kept: int | None = None) -> PackCounts:
    """end_N: where each anchor's context ends (exclusive); context_N: how many positions before it it attends;
    kept: context positions a read-mode step computes (None: the pack's real tokens)."""
    read = _covered(end_N - context_N, end_N, batch.num_tokens)
    return PackCounts(tokens=batch.num_real_tokens, documents=_documents(batch), anchors=int(anchors_N.numel()),
                      context_keys=int(context_N.sum()), context_read=read,
                      context_kept=batch.num_real_tokens if kept is None else kept,
                      scored=tuple(int(m) for m in valid_NK.sum(0).tolist()),
                      targets=int(torch.unique(target_pos).numel()))


def _dflash_counts(drafter, batch: PackedBatch, generator) -> PackCounts:
    anchors_N = drafter.select_anchors(batch, generator)  # the step's own sampling (DFlashDrafter.training_step)
    if drafter.name == "dspark":  # slot k learns the target's distribution at p+k (its own state)
        valid_NK, state_NK, _ = drafter.draft_rows(batch, anchors_N)
        target_pos = state_NK[valid_NK]
    else:  # slot k learns the target's token at p+k, from its state at p+k-1
        pos_NK, valid_NK = drafter.label_positions(batch, anchors_N)
        target_pos = pos_NK[valid_NK] - 1
    # An anchor block sees its document's context before the anchor, within the window (kernels/attention/reference.py)
    context_N = _before_in_document(batch, anchors_N)
    if drafter.cfg.sliding_window is not None:
        context_N = context_N.clamp(max=drafter.cfg.sliding_window)
    kept_C = window_context(batch.document_ids_T, anchors_N, drafter.cfg.sliding_window)
    return _counts(batch, anchors_N, anchors_N, context_N, valid_NK, target_pos,
                   None if kept_C is None else int(kept_C.numel()))


def _mtp_counts(drafter, batch: PackedBatch, generator) -> PackCounts:
    anchors_N = drafter.select_anchors(batch, generator)
    pos_NK, valid_NK = drafter.label_positions(batch, anchors_N)
    # A chain starts at p-1 and sees the cache entries of its document before it: p-1 of them (no window).
    starts_N = anchors_N - 1
    return _counts(batch, anchors_N, starts_N, _before_in_document(batch, starts_N), valid_NK, pos_NK[valid_NK] - 1)


def _eagle3_counts(drafter, batch: PackedBatch, generator) -> PackCounts:
    pairs = drafter.pairs(batch)
    pos_SK, valid_SK = drafter.chain_labels(batch, pairs)
    chain_S_N = drafter.unrolled_chains(valid_SK)
    pos_NK, valid_NK = pos_SK[chain_S_N], valid_SK[chain_S_N]
    # A chain at the pair of token t sees the step-0 keys of its document up to its own: position(t) of them.
    t_N = pairs.t_S[chain_S_N]
    return _counts(batch, chain_S_N, t_N + 1, _before_in_document(batch, t_N), valid_NK, pos_NK[valid_NK] - 1)


_COUNTS = {"dflash": _dflash_counts, "dspark": _dflash_counts, "dflash2": _dflash_counts, "mtp": _mtp_counts,
           "eagle3": _eagle3_counts}


@torch.no_grad()
def pack_counts(drafter, batch: PackedBatch, generator: torch.Generator | None = None) -> PackCounts:
    """The counts of the step `drafter(batch, head, generator)` would take, from the drafter's own anchor and label
    helpers run on a copy of `generator` (so pass it in the state the step will get it)."""
    if drafter.name not in _COUNTS:
        raise ValueError(f"no FLOP count for drafter {drafter.name!r}; valid: {sorted(_COUNTS)}")
    return _COUNTS[drafter.name](drafter, batch, _generator_copy(generator))


class _Tally:
    """FLOPs per part of the step: forward, backward (model) and overhead (executed beyond the model)."""

    def __init__(self):
        self.parts: dict[str, list[float]] = {}
        self.attention_parts: set[str] = set()
        self.unused = 0.0  # model FLOPs on rows whose result no loss reads

    def add(self, part: str, forward=0.0, backward=0.0, overhead=0.0):
        entry = self.parts.setdefault(part, [0.0, 0.0, 0.0])
        entry[0] += forward
        entry[1] += backward
        entry[2] += overhead

    def linear(self, part, rows, d_in, d_out, weight_grad=True, input_grad=True, recomputed=False):
        """[rows, d_in] x [d_in, d_out]; `recomputed`: the chunked loss forms it again in backward."""
        f = 2.0 * rows * d_in * d_out
        self.add(part, f, f * (int(weight_grad) + int(input_grad)), f if recomputed else 0.0)

    def attention(self, part, pairs, heads, head_dim, executed_pairs=None):
        """Scores and values over `pairs` (query, key) pairs per query head; backward 2x (dQ, dK, dV, dP)."""
        f = 4.0 * pairs * heads * head_dim
        extra = 4.0 * (executed_pairs - pairs) * heads * head_dim if executed_pairs is not None else 0.0
        self.attention_parts.add(part)
        self.add(part, f, 2 * f, 3 * extra)

    def result(self) -> dict:
        fwd = sum(p[0] for p in self.parts.values())
        bwd = sum(p[1] for p in self.parts.values())
        over = sum(p[2] for p in self.parts.values())
        attn = [self.parts[a] for a in self.attention_parts]
        return {"model": fwd + bwd, "forward": fwd, "backward": bwd, "overhead": over, "executed": fwd + bwd + over,
                "unused": self.unused,
                "attention_model": sum(p[0] + p[1] for p in attn),
                "attention_executed": sum(sum(p) for p in attn),
                "parts": {name: p[0] + p[1] for name, p in self.parts.items()},
                "parts_overhead": {name: p[2] for name, p in self.parts.items() if p[2]}}


def _dense_layer(t: _Tally, part: str, rows, shape, qkv_in=None, query_rows=None):
    """Qwen3 decoder layer's matmuls on `rows` rows (attention products apart); qkv_in: q/k/v input width;
    query_rows: the rows whose q, o_proj and MLP run, K/V at all `rows` (default: all of them)."""
    D, qd, kvd = shape.hidden, shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    q_rows = rows if query_rows is None else query_rows
    t.linear(part, rows, qkv_in or D, 2 * kvd)
    t.linear(part, q_rows, qkv_in or D, qd)
    t.linear(part, q_rows, qd, D)
    t.linear(part, q_rows, D, 2 * shape.intermediate)  # gate, up
    t.linear(part, q_rows, shape.intermediate, D)  # down


def _target_logits(t: _Tally, U, M, D, V, keep: bool, head_trained: bool = False):
    """The target's logits a vocabulary loss compares with: once per distinct position where the step keeps them
    (targets.DistinctTargets within its budget, fp32), else per scored row in each chunk: in forward, and again in
    backward where the draft head's weight is trained (kernels/logits/chunked.py)."""
    if keep and U * V * 4 <= TARGET_LOGITS_BUDGET:
        t.linear("target", U, D, V, weight_grad=False, input_grad=False)
    else:
        t.linear("target", M, D, V, weight_grad=False, input_grad=False, recomputed=head_trained)


def _dflash_flops(drafter, c: PackCounts) -> dict:
    """DFlash backbone (shared by DSpark, DFlash 2) + each one's heads."""
    cfg, s, t = drafter.cfg, drafter.shape, _Tally()
    D, V, B, L = s.hidden, drafter.target.vocab_size, drafter.block_size, len(drafter.layers)
    T, N, M, U = c.tokens, c.anchors, c.M, c.targets
    Q, kvd, qd = N * B, s.num_kv_heads * s.head_dim, s.num_heads * s.head_dim
    kept = c.context_kept if drafter.compute == "read" else T  # read: only where some window reaches
    t.linear("fc", kept, len(drafter.target_layer_ids) * D, D, input_grad=False)  # reads target states
    for _ in range(L):
        t.linear("context_kv", kept, D, 2 * kvd)  # every layer projects the context to K/V
        t.linear("block_layers", Q, D, qd + 2 * kvd)
        t.linear("block_layers", Q, qd, D)
        t.linear("block_layers", Q, D, 2 * s.intermediate)
        t.linear("block_layers", Q, s.intermediate, D)
    # Context outside every anchor's window: its fc rows and K/V are computed, read by no query.
    t.unused += (kept - c.context_read) * (4.0 * len(drafter.target_layer_ids) * D * D + L * 6.0 * D * 2 * kvd)
    in_block = B * (B + 1) // 2 if cfg.causal_in_block else B * B
    t.attention("attention", L * (B * c.context_keys + N * in_block), s.num_heads, s.head_dim)
    _DFLASH_HEADS[drafter.name](drafter, t, D, V, Q, M, U)
    return t.result()


def _dflash_head(drafter, t, D, V, Q, M, U):
    # The target's lm_head, frozen: the chunked loss forms dloss/dh in forward (no recomputation).
    t.linear("vocab_head", M, D, V, weight_grad=False)
    if drafter.cfg.loss == "kl":  # target logits: once per position (read) or per scored row in each chunk (all)
        _target_logits(t, U, M, D, V, keep=drafter.compute == "read")
    else:  # greedy target token once per distinct position
        t.linear("target", U, D, V, weight_grad=False, input_grad=False)


def _dspark_head(drafter, t, D, V, Q, M, U):
    cfg, r = drafter.cfg, (drafter.cfg.markov_rank if drafter.markov_head is not None else 0)
    # logits = [h; f] @ [W_lm; W2]^T in one chunked KL: W_lm frozen, W2 trained. The concatenated weight needs a
    # gradient, so the chunked backward forms dW over all D + r columns: the W_lm part is overhead.
    t.linear("vocab_head", M, D, V, weight_grad=False, recomputed=bool(r))  # without a Markov head: W_lm alone, frozen
    if r:
        t.linear("vocab_head", M, r, V, recomputed=True)
        t.add("vocab_head", overhead=2.0 * M * D * V)
    _target_logits(t, U, M, D, V, keep=drafter.compute == "read", head_trained=bool(r))
    if drafter.markov_head is not None and cfg.markov_head_type == "gated":
        t.linear("markov", Q, D + r, r)
    elif drafter.markov_head is not None and cfg.markov_head_type == "rnn":
        t.linear("markov", Q, 2 * r + D, 3 * r)
    if drafter.confidence_head is not None:
        t.linear("confidence", Q, D + (r if cfg.confidence_head_with_markov else 0), 1)


def _dflash2_head(drafter, t, D, V, Q, M, U):
    cfg = drafter.cfg
    G = D // cfg.conv_group_size
    for _ in range(2 * len(drafter.layers)):  # attention and MLP convolutions' dynamic kernels, per layer
        t.linear("conv", Q, D, 2 * cfg.conv_kernel_size * G)
    t.linear("vocab_head", M, D, V, weight_grad=False)  # frozen: its gradient formed in forward
    _target_logits(t, U, M, D, V, keep=drafter.compute == "read")
    t.linear("selector", M, D, V, weight_grad=False, input_grad=False)  # top-k candidates: a third vocab matmul
    t.linear("selector", M, D, cfg.selector_top_k, weight_grad=False)  # unary logits of the candidates
    t.linear("selector", M, D, cfg.selector_rank)  # hidden_projection


_DFLASH_HEADS = {"dflash": _dflash_head, "dspark": _dspark_head, "dflash2": _dflash2_head}


def _mtp_flops(drafter, c: PackCounts) -> dict:
    s, t, K = drafter.shape, _Tally(), drafter.num_speculative_tokens
    D, V, T, N, U = s.hidden, drafter.target.vocab_size, c.tokens, c.anchors, c.targets
    qd, kvd = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    # The MTP KV cache as vLLM fills it: fc fusion and K/V at every position (its norms train: inputs need grads).
    t.linear("context", T, 2 * D, D)
    t.linear("context", T, D, 2 * kvd)
    for k in range(1, K + 1):
        if k > 1:
            t.linear("chain_layer", N, 2 * D, D)  # step 1 reuses the context's fusion
        t.linear("chain_layer", N, D, 2 * qd + 2 * kvd)  # q_proj gives [query | gate]
        t.linear("chain_layer", N, qd, D)
        t.linear("moe", N, D, s.num_experts)  # router
        t.linear("moe", N * s.top_k, D, 2 * s.moe_intermediate)  # routed experts: top-k rows per token
        t.linear("moe", N * s.top_k, s.moe_intermediate, D)
        t.linear("moe", N, D, 2 * s.shared_intermediate + 1)  # shared expert gate/up + its sigmoid gate
        t.linear("moe", N, s.shared_intermediate, D)
        # Step k's query sees the context and its chain's k entries; the step recomputes slots 1..k-1 too.
        model = c.context_keys + N * k
        executed = k * c.context_keys + N * k * (k + 1) // 2
        t.attention("attention", model, s.num_heads, s.head_dim, executed_pairs=executed)
    t.linear("vocab_head", c.M, D, V, weight_grad=False)  # the target's lm_head, frozen: gradient formed in forward
    t.linear("target", U, D, V, weight_grad=False, input_grad=False)
    return t.result()


def _eagle3_flops(drafter, c: PackCounts) -> dict:
    cfg, s, t = drafter.cfg, drafter.shape, _Tally()
    D, V, Vd, N, U = s.hidden, drafter.target.vocab_size, drafter.draft_vocab_size, c.anchors, c.targets
    if N == 0:  # no scored chain: the step returns a zero loss without a forward
        return t.result()
    S = sum(n - 1 for n in c.documents)  # pairs (token t, state t-1)
    L, causal, read = len(drafter.layers), sum((n - 1) * n // 2 for n in c.documents), drafter.compute == "read"
    t.linear("fc", S, len(drafter.target_layer_ids) * D, D, input_grad=False)
    for i in range(L):  # step 0; read: the last layer's q, o and MLP at the chains only, its K/V at every pair
        last = i == L - 1
        _dense_layer(t, "pair_layers", S, s, qkv_in=2 * D if i == 0 else None,  # the first reads [emb; hidden]
                     query_rows=N if read and last else None)
    for _ in range(1, cfg.ttt_steps):
        for i in range(L):
            _dense_layer(t, "chain_layers", N, s, qkv_in=2 * D if i == 0 else None)
    # Step 0: causal over each row's pairs; read: the last layer's chain queries see c_n step-0 keys each.
    t.attention("attention", (L - 1) * causal + (c.context_keys if read else causal), s.num_heads, s.head_dim)
    if not read:  # step 0's last layer feeds the loss only at the N chain pairs; elsewhere only its K/V are read
        last_in, qd = (2 * D if L == 1 else D), s.num_heads * s.head_dim
        t.unused += 6.0 * (S - N) * (last_in * qd + qd * D + 3 * D * s.intermediate)
        t.unused += 12.0 * s.num_heads * s.head_dim * (causal - c.context_keys)  # chain n's step-0 query: c_n keys
    for step in range(1, cfg.ttt_steps):  # context up to the anchor + the chain's own keys of steps 1..step
        t.attention("attention", L * (c.context_keys + N * step), s.num_heads, s.head_dim)
    t.linear("vocab_head", c.M, D, Vd, weight_grad=cfg.train_lm_head, recomputed=cfg.train_lm_head)
    t.linear("target", U, D, V, weight_grad=False, input_grad=False)  # greedy token over the whole vocabulary
    _target_logits(t, U, c.M, D, Vd, keep=True)  # kept per position in either mode (targets.DistinctTargets)
    return t.result()


_FLOPS = {"dflash": _dflash_flops, "dspark": _dflash_flops, "dflash2": _dflash_flops, "mtp": _mtp_flops,
          "eagle3": _eagle3_flops}


def step_flops(drafter, counts: PackCounts) -> dict:
    """FLOPs of one training step's forward + backward (module docstring): keys model, forward, backward, overhead,
    executed, unused, attention_model, attention_executed, parts {name: model FLOPs}, parts_overhead."""
    if drafter.name not in _FLOPS:
        raise ValueError(f"no FLOP count for drafter {drafter.name!r}; valid: {sorted(_FLOPS)}")
    return _FLOPS[drafter.name](drafter, counts)


def muon_matrices(drafter, cfg: TrainerConfig | None = None) -> list[tuple[tuple[int, ...], float]]:
    """(shape, Newton-Schulz FLOPs) of every matrix Muon steps (the trainer's Optimizers split; optim.py's
    newton_schulz_flops: per matrix of min side m and max side n, ns_steps x (X X^T: 2 m^2 n, A A: 2 m^3, B X:
    2 m^2 n))."""
    return [(tuple(p.shape), newton_schulz_flops(p.shape, group["ns_steps"]))
            for opt in Optimizers(drafter, cfg or TrainerConfig()).optimizers if isinstance(opt, torch.optim.Muon)
            for group in opt.param_groups for p in group["params"]]


def optimizer_flops(drafter, cfg: TrainerConfig | None = None) -> float:
    """Muon's Newton-Schulz FLOPs per optimizer step, all matrices (AdamW's elementwise work not counted). Paid once
    per optimizer step whatever the pack (trainer.grad_accum packs share it), split over the ranks (`muon_split`)."""
    return sum(flops for _, flops in muon_matrices(drafter, cfg))


def muon_split(matrices: list[tuple[tuple[int, ...], float]], ranks: int) -> dict:
    """Muon over `ranks` trainer ranks as GatheredMuon splits it (specdistill/trainer/optim.py): the busiest rank's
    Newton-Schulz FLOPs, and the bytes one rank receives per optimizer step (the most over ranks; bf16, as on CUDA)
    for DDP split (the owners' broadcasts; unsplit: none), FSDP unsplit (every update all-gathered, fp32) and FSDP
    split (its rows of each update to the owner, the owner's result rows back)."""
    shapes, costs = [shape for shape, _ in matrices], [flops for _, flops in matrices]
    owners = assign_owners(costs, ranks)
    out = dict(busiest=0.0, ddp_bytes=0, fsdp_unsplit_bytes=0, fsdp_bytes=0)
    for rank in range(ranks):
        mine = [o == rank for o in owners]
        local = [shard_rows(rows, ranks)[rank] * cols for rows, cols in shapes]  # this rank's shard, elements
        others = [math.prod(shape) - own for shape, own in zip(shapes, local)]  # the other ranks' rows
        received = {"busiest": sum(c for c, m in zip(costs, mine) if m),
                    "ddp_bytes": 2 * sum(math.prod(s) for s, m in zip(shapes, mine) if not m),
                    "fsdp_unsplit_bytes": 4 * sum(others),
                    "fsdp_bytes": 2 * sum(o if m else own for o, own, m in zip(others, local, mine))}
        out = {k: max(v, received[k]) for k, v in out.items()}
    return out


# --- production numbers (counts only) ---------------------------------------------------------------------------
def production_target(path: Path):
    """bench/production_target.py's target directory at PRODUCTION geometry, config.json only: a meta-device build
    reads nothing else, so its 2 x 509M-value random tables are neither drawn nor written."""
    from bench import production_target as geometry

    with mock.patch.object(geometry, "save_file"), mock.patch("torch.randn", lambda *a, **k: torch.zeros(0)):
        return geometry.write_target(path, geometry.PRODUCTION, torch.device("cpu"))


def meta_drafter(name: str, info):
    """The drafter with its production defaults on the meta device (shapes only; as drafter_steps.build)."""
    overrides = {"init_from_target": False} if name in ("dflash", "dspark", "dflash2") else {}
    cfg = drafter_config(name, overrides)
    cls = DRAFTERS[name][1]
    with torch.device("meta"), mock.patch("specdistill.drafters.mtp.read_mtp_state", lambda path, state: state):
        drafter = cls(cfg, info) if name in ("mtp", "eagle3") else cls(cfg, info, MASK_TOKEN_ID)
    return drafter.train()


def mission_rows(rows: int, response_tokens: int, info) -> PackedBatch:
    """`rows` rows of bench/production_target.py's mission pack (6 rows of ~5.4k tokens, repeated), each ending in
    `response_tokens` scored tokens; no target states (counts only)."""
    if rows % ROWS_PER_PACK:
        raise ValueError(f"rows={rows}: a multiple of the mission pack's {ROWS_PER_PACK} rows")
    one = mission_pack(info, (), 32768, torch.device("cpu"))  # states [T, 0, D]: nothing drawn
    copies = rows // ROWS_PER_PACK
    lengths = torch.bincount(one.document_ids_T).repeat(copies)
    document_ids_T = torch.repeat_interleave(torch.arange(rows), lengths)
    position_ids_T = one.position_ids_T.repeat(copies)
    return PackedBatch(input_ids_T=one.input_ids_T.repeat(copies),
                       loss_mask_T=position_ids_T >= lengths[document_ids_T] - response_tokens,
                       hidden_TLD=one.hidden_TLD.repeat(copies, 1, 1), document_ids_T=document_ids_T,
                       position_ids_T=position_ids_T, layer_ids=(), row_ids=tuple(range(rows)))


PACK_TOKENS = 32768


def shipped_rows(spec: FeatureSpec, response_tokens: int, info) -> PackedBatch:
    """A pack of the mission's rows as feature_server.positions=read ships them for `spec` and the planner packs them
    (core/contract.py, docs/scaling.md "What ships"): whole rows when the spec's context layers ship whole (the
    mission pack, mission_rows(6, ...)); a windowed spec's rows cut to window + response positions (their own
    position ids kept), as many as fit PACK_TOKENS."""
    if spec.context_window is None:
        return mission_rows(6, response_tokens, info)
    whole = mission_rows(6, response_tokens, info)
    lengths = torch.bincount(whole.document_ids_T).tolist()
    n = spec.context_window + response_tokens
    rows = PACK_TOKENS // n
    starts = [lengths[r % len(lengths)] - n for r in range(rows)]
    document_ids_T = torch.arange(rows).repeat_interleave(n)
    position_ids_T = torch.cat([torch.arange(s, s + n) for s in starts])
    return PackedBatch(input_ids_T=torch.zeros(rows * n, dtype=torch.long),
                       loss_mask_T=(torch.arange(rows * n) % n) >= n - response_tokens,
                       hidden_TLD=whole.hidden_TLD.new_zeros(rows * n, 0, info.hidden_size), document_ids_T=document_ids_T,
                       position_ids_T=position_ids_T, layer_ids=(), row_ids=tuple(range(rows)))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafters", default="dflash,mtp,eagle3,dspark,dflash2")
    ap.add_argument("--packs", default="6x45,6x171,24x45",
                    help="ROWSxRESPONSE,...: packs of ROWS mission rows (~5.4k tokens) ending in RESPONSE scored "
                         "tokens each (6x45: the mission's; 6x171 and 24x45 fill max_anchors=1024)")
    ap.add_argument("--step-ms", default="", help="measured step times of the mission pack (name=ms,...): MFU")
    ap.add_argument("--peak-tflops", type=float, default=DENSE_BF16_PEAK_TFLOPS["H200"])
    ap.add_argument("--ranks", default="1,2,8", help="trainer ranks to split Muon's Newton-Schulz over (R,...)")
    ap.add_argument("--grad-accum", default="1,4", help="trainer.grad_accum values for Muon's share (g,...)")
    args = ap.parse_args()
    step_ms = {k: float(v) for k, v in (item.split("=") for item in args.step_ms.split(",") if item)}
    with tempfile.TemporaryDirectory() as tmp:  # MTP reads config.json when built
        info = production_target(Path(tmp) / "target")
        report(args, info, step_ms)
        muon_report(args, info)


def report(args, info, step_ms: dict):
    packs = [tuple(int(x) for x in p.split("x")) for p in args.packs.split(",")]
    print(f"target: hidden {info.hidden_size}, vocab {info.vocab_size}, {info.num_hidden_layers} layers. TFLOP per "
          "step: model = forward + backward (the MFU numerator), executed = + recomputation, unused = model work "
          "no loss reads, Muon = the optimizer's Newton-Schulz; per anchor: model GFLOP / N; compute = "
          "trainer.compute (MFU: the step times given are read's)\n")
    print("| drafter | compute | pack | T | N | M | U | model | per anchor | executed | unused | Muon | MFU | "
          "largest parts (model) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name in args.drafters.split(","):
        drafter = meta_drafter(name, info)
        opt = optimizer_flops(drafter)
        cases = [(f"{rows}x{response}", mission_rows(rows, response, info)) for rows, response in packs]
        read = FeatureSpec.union([drafter.feature_spec()], positions="read")
        if read.context_window is not None:  # positions=read: a windowed drafter's rows packed by what ships
            for response in sorted({r for _, r in packs}):
                batch = shipped_rows(read, response, info)
                cases.append((f"{len(batch.row_ids)}x{response} shipped", batch))
        for label, batch in cases:
            c = pack_counts(drafter, batch)
            rows, response = len(batch.row_ids), int(batch.loss_mask_T.sum()) // len(batch.row_ids)
            for compute in COMPUTE_MODES:
                drafter.compute = compute
                f = step_flops(drafter, c)
                parts = ", ".join(f"{k} {v / 1e12:.2f}"
                                  for k, v in sorted(f["parts"].items(), key=lambda kv: -kv[1])[:4])
                mfu = (f"{f['model'] / (step_ms[name] / 1e3) / (args.peak_tflops * 1e12):.3f}"
                       if name in step_ms and (rows, response) == (6, 45) and compute == "read" else "")
                print(f"| {name} | {compute} | {label} | {c.tokens:,} | {c.anchors:,} | {c.M:,} | "
                      f"{c.targets:,} | {f['model'] / 1e12:.2f} | {f['model'] / max(c.anchors, 1) / 1e9:.1f} | "
                      f"{f['executed'] / 1e12:.2f} | {f['unused'] / 1e12:.2f} | {opt / 1e12:.2f} | {mfu} | {parts} |")


def muon_report(args, info):
    """Muon split over R ranks: the busiest rank's Newton-Schulz, its share of that rank's matmul FLOPs per optimizer
    step (g mission packs' executed FLOPs each, plus Muon), and the bytes one rank receives for it."""
    ranks, accum = ([int(x) for x in arg.split(",")] for arg in (args.ranks, args.grad_accum))
    print("\nMuon per optimizer step over R trainer ranks (GatheredMuon: each matrix orthogonalised on one rank, "
          "balanced by FLOPs): the busiest rank's TFLOP; its share of that rank's matmul FLOPs per step, with "
          "trainer.grad_accum = g mission packs (executed) per rank; MB one rank receives per step for it (bf16 as "
          "on CUDA; DDP unsplit: none)\n")
    print(f"| drafter | R | Muon TFLOP, busiest rank | {' | '.join(f'share, g = {g}' for g in accum)} | DDP MB | "
          "FSDP unsplit MB | FSDP MB |")
    print("|---" * (6 + len(accum)) + "|")
    for name in args.drafters.split(","):
        drafter = meta_drafter(name, info)
        matrices = muon_matrices(drafter)
        pack = step_flops(drafter, pack_counts(drafter, mission_rows(6, 45, info)))["executed"]
        for R in ranks:
            split = muon_split(matrices, R)
            shares = " | ".join(f"{split['busiest'] / (g * pack + split['busiest']):.1%}" for g in accum)
            print(f"| {name} | {R} | {split['busiest'] / 1e12:.2f} | {shares} | {split['ddp_bytes'] / 1e6:,.0f} | "
                  f"{split['fsdp_unsplit_bytes'] / 1e6:,.0f} | {split['fsdp_bytes'] / 1e6:,.0f} |")


if __name__ == "__main__":
    main()
