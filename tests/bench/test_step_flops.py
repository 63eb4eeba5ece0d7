"""bench/step_flops.py's analytic count against torch's FlopCounterMode over the step itself, per drafter and per
trainer.compute (read and all), on CPU at bench/drafter_steps.py's SMALL geometry in fp32 (a 1,024-token mission pack:
6 rows, 45 scored tokens each).

On CPU the counter sees matmuls (mm, addmm, bmm) but no attention: the CPU SDPA kernel has no FLOP formula (it counts
0). Under the math SDPA backend attention runs as bmm and is counted, dense over the keys each SDPA call is given.
So a drafter's step runs twice:
  - default backend: the counter's total is the step's matmuls, and the analytic executed matmuls must equal it
    (rel 1e-6, not a few %: the counter adds 2 m k n per matmul exactly, so any gap is a matmul the formula misses or
    invents; DSpark's one-logit confidence head, 0.01% of its step, would fail a 2% check unseen);
  - math backend: the difference is the attention the CPU chunked path computes. That path groups queries into
    segments over a range of keys and computes the masked products inside a segment: 1.8-3.5x the pairs the masks
    allow here (the counted/analytic attention ratio printed is 0.28-0.56). The analytic count takes only the allowed
    pairs (what compiled flex attention computes, up to its partly masked 128 x 128 tiles). Both are checked exactly:
    the analytic pairs against the reference masks, the counted attention against the chunked plans' segment products.
    So the total is not compared with a loose tolerance: counted = analytic executed + that known excess (rel 1e-6),
    and the raw analytic/counted total (0.89-0.98 here) is printed with -s.
MoE experts run the reference per-expert loop: on CPU the grouped kernel's padded layout multiplies pad rows
(up to 1.5x the routed rows; specdistill/kernels/moe/grouped.py), which is CPU-only work the count leaves out.
"""

from contextlib import nullcontext

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from bench.drafter_steps import build
from bench.production_target import SMALL, mission_pack, write_target
from bench.step_flops import meta_drafter, mission_rows, pack_counts, production_target, step_flops
from specdistill.core.batch import layout_ids
from specdistill.core.target import TargetHead
from specdistill.drafters.dflash import BlockContext
from specdistill.drafters.eagle3 import ChainAttention
from specdistill.kernels.attention import anchor_block_mask, chunked, packed_causal_mask

PACK = 1024
SEED = 0
# Per drafter, beside "chunked" attention: a window shorter than some anchors' context (rows are ~170 tokens) and
# fewer anchors than response tokens (270), so the window and the generator's sampling both shape the count.
OVERRIDES = {"dflash": {"sliding_window": 150, "max_anchors": 100}, "dspark": {"sliding_window": 150},
             "dflash2": {"max_anchors": 200}, "mtp": {"max_anchors": 100}, "eagle3": {}}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    info = write_target(tmp_path_factory.mktemp("target"), SMALL, torch.device("cpu"))
    return info, TargetHead(info)


def small_drafter(name, info):
    drafter = build(name, info, torch.device("cpu"))
    for key, value in {"attention_impl": "chunked", **OVERRIDES[name]}.items():
        setattr(drafter.cfg, key, value)  # read at step time
    if name == "mtp":
        drafter.layers[0].mlp.impl = "reference"  # module docstring: no pad rows
    return drafter


def counted(drafter, batch, head, math: bool) -> float:
    backend = sdpa_kernel(SDPBackend.MATH) if math else nullcontext()
    with backend, FlopCounterMode(display=False) as counter:
        drafter(batch, head, torch.Generator().manual_seed(SEED)).loss.backward()
    drafter.zero_grad(set_to_none=True)
    return float(counter.get_total_flops())


def _products(plan) -> int:
    return sum(q * k for q, k in zip(plan.q_sizes, plan.k_sizes))


def attention_pairs(drafter, batch) -> tuple[int, int, int]:
    """(model, executed, chunked) (query, key) pairs of the step's attention, all layers: the reference masks'
    allowed pairs (model: the queries whose output is used; executed: every query the step computes) and the
    products the CPU chunked plans compute."""
    g, doc = torch.Generator().manual_seed(SEED), batch.document_ids_T
    if drafter.name == "mtp":
        starts, K = drafter.select_anchors(batch, g) - 1, drafter.num_speculative_tokens
        model = executed = dense = 0
        for k in range(1, K + 1):  # step k: a causal block of k slots per chain, only the last one used
            mask = anchor_block_mask(doc, starts, k, None, True)
            model += int(mask.view(starts.numel(), k, -1)[:, -1].sum())
            executed += int(mask.sum())
            dense += _products(chunked.anchor_block_plan(doc, starts, k, None, True))
        return model, executed, dense
    if drafter.name == "eagle3":
        pairs = drafter.pairs(batch)
        chain = drafter.unrolled_chains(drafter.chain_labels(batch, pairs)[1])
        L, groups = len(drafter.layers), ChainAttention(pairs.document_ids_S, chain).groups
        causal = int(packed_causal_mask(pairs.document_ids_S).sum())
        causal_dense = _products(chunked.packed_causal_plan(pairs.document_ids_S))
        at_chains = sum(int(ctx.sum()) for *_, ctx in groups)  # step 0's chain queries over the step-0 keys
        at_chains_dense = sum((n1 - n0) * (hi - lo) for n0, n1, lo, hi, _ in groups)
        if drafter.compute == "read":  # step 0's last layer: queries at the chains only
            exact, dense = (L - 1) * causal + at_chains, (L - 1) * causal_dense + at_chains_dense
        else:
            exact, dense = L * causal, L * causal_dense
        for s in range(1, drafter.cfg.ttt_steps):  # context mask + the chain's own key of each step 1..s
            exact += L * (at_chains + s * chain.numel())
            dense += L * sum((n1 - n0) * ((hi - lo) + s * (n1 - n0)) for n0, n1, lo, hi, _ in groups)
        return exact, exact, dense
    cfg, B, L = drafter.cfg, drafter.block_size, len(drafter.layers)
    anchors = drafter.select_anchors(batch, g)
    exact = int(anchor_block_mask(doc, anchors, B, cfg.sliding_window, cfg.causal_in_block).sum())
    # The chunked plan as the step builds it: over the compacted context with compute='read'.
    context = BlockContext.of(batch, anchors, cfg.sliding_window, read=drafter.compute == "read")
    dense = _products(chunked.anchor_block_plan(context.document_ids_C, context.anchors_N, B, cfg.sliding_window,
                                                cfg.causal_in_block))
    return L * exact, L * exact, L * dense


# MTP computes the same either way (trainer.compute).
@pytest.mark.parametrize("name,compute", [(name, compute) for name in ("dflash", "dspark", "dflash2", "eagle3")
                                          for compute in ("read", "all")] + [("mtp", "read")])
def test_analytic_flops_match_the_counted_step(name, compute, target):
    info, head = target
    drafter = small_drafter(name, info)
    drafter.compute = compute
    batch = mission_pack(info, drafter.feature_spec().layer_ids, PACK, torch.device("cpu")).to("cpu", torch.float32)
    flops = step_flops(drafter, pack_counts(drafter, batch, torch.Generator().manual_seed(SEED)))
    matmuls, with_attention = counted(drafter, batch, head, math=False), counted(drafter, batch, head, math=True)

    heads, head_dim = (drafter.shape.num_heads, drafter.shape.head_dim)
    per_pair = 12.0 * heads * head_dim  # scores + values, forward and backward (2x)
    model_pairs, executed_pairs, chunked_pairs = attention_pairs(drafter, batch)
    assert flops["attention_model"] == per_pair * model_pairs  # exactly the pairs the masks allow
    assert flops["attention_executed"] == per_pair * executed_pairs
    assert with_attention - matmuls == pytest.approx(per_pair * chunked_pairs, rel=1e-6)

    analytic_matmuls = flops["executed"] - flops["attention_executed"]
    excess = per_pair * (chunked_pairs - executed_pairs)  # masked products inside the chunked path's segments
    print(f"\n{name}: matmuls analytic {analytic_matmuls:.4g} / counted {matmuls:.4g} = "
          f"{analytic_matmuls / matmuls:.6f}; attention analytic {flops['attention_executed']:.4g} / counted "
          f"{with_attention - matmuls:.4g} = {flops['attention_executed'] / (with_attention - matmuls):.3f}; total "
          f"analytic {flops['executed']:.4g} / counted {with_attention:.4g} = {flops['executed'] / with_attention:.4f}"
          f" (+ chunked excess: {(flops['executed'] + excess) / with_attention:.4f}); model {flops['model']:.4g}")
    assert analytic_matmuls == pytest.approx(matmuls, rel=1e-6)
    assert flops["executed"] + excess == pytest.approx(with_attention, rel=1e-6)
    assert flops["model"] <= flops["executed"]


def test_padding_is_not_counted(target):
    """A pack laid out over more tokens (a padding document after the rows) counts as its rows do."""
    info, _ = target
    drafter = small_drafter("dflash", info)
    batch = mission_pack(info, (), PACK, torch.device("cpu"))
    lengths = torch.bincount(batch.document_ids_T).tolist()
    doc, pos = layout_ids(lengths, PACK + 300)
    padded = type(batch)(input_ids_T=torch.cat([batch.input_ids_T, torch.zeros(300, dtype=torch.long)]),
                         loss_mask_T=torch.cat([batch.loss_mask_T, torch.zeros(300, dtype=torch.bool)]),
                         hidden_TLD=torch.zeros(PACK + 300, 0, info.hidden_size), document_ids_T=doc,
                         position_ids_T=pos, layer_ids=(), row_ids=batch.row_ids, real_tokens=PACK)
    assert pack_counts(drafter, padded) == pack_counts(drafter, batch)
    assert pack_counts(drafter, batch).tokens == PACK


def test_production_counts_of_the_mission_pack(tmp_path):
    """Meta-device drafters at the production geometry (what `python bench/step_flops.py` prints): the mission pack
    trains every response token as an anchor, 6 x 45 = 270, far below max_anchors."""
    info = production_target(tmp_path / "target")
    drafter = meta_drafter("dflash", info)
    counts = pack_counts(drafter, mission_rows(6, 45, info))
    assert counts.anchors == 270 and counts.tokens == 32768 and len(counts.documents) == 6
    filled = pack_counts(drafter, mission_rows(6, 171, info))
    assert filled.anchors == drafter.cfg.max_anchors == 1024
    assert step_flops(drafter, filled)["model"] > 2.5 * step_flops(drafter, counts)["model"]
