"""trainer.compute=read computes only what a loss, a metric or a served draft reads (specdistill/drafters/base.py
COMPUTE_MODES): EAGLE-3's last layer at the chain anchors only (the layers below it at every pair), the DFlash family's
fc and K/V only where some anchor's window reaches, DSpark's and DFlash 2's (and DFlash's KL) target logits once per
distinct position. On the same packs and anchors it gives the loss, metrics, gradients and held-out drafts of
compute=all (fp32; rtol 1e-5, a gradient's relative Frobenius error: summation order only), on rows longer and shorter than the window, four documents per
pack, unpadded and padded to the run's fixed shapes; and it really computes fewer rows (counted by forward hooks) and
gives a compiled kernel no shape that compute=all does not."""

from contextlib import contextmanager
from dataclasses import replace

import pytest
import torch

from specdistill.core.batch import pack
from specdistill.core.shapes import StaticShapes
from specdistill.core.target import TargetHead, TargetInfo
from specdistill.drafters.dflash import window_context
from specdistill.drafters.eagle3 import Eagle3Config, Eagle3Drafter
from specdistill.kernels.logits import chunked as chunked_logits
from tests.drafters.batches import make_samples, small_drafter, step_and_grads
from tests.drafters.parity import RTOL, relative_error

PACK = 224  # the token budget of the padded packs
WINDOW = 16
LENGTHS, RESPONSE = (70, 12, 45, 30), (14, 5, 12, 8)  # rows longer and shorter than the window (161 tokens)
# case: (drafter, config fields set before the steps). Fewer anchors than the 39 response tokens: windows with gaps.
CASES = {
    "eagle3": ("eagle3", {}),
    "eagle3-2-layers": ("eagle3", {"num_layers": 2}),
    "dflash": ("dflash", {"sliding_window": WINDOW, "max_anchors": 24}),
    "dflash-kl-no-window": ("dflash", {"sliding_window": None, "max_anchors": 24, "loss": "kl"}),
    "dspark": ("dspark", {"sliding_window": WINDOW, "max_anchors": 24}),
    "dflash2": ("dflash2", {"sliding_window": WINDOW}),
}
KEPT_LOGITS = {"dflash-kl-no-window", "dspark", "dflash2"}  # read forms the target's logits once per position


def make_drafter(case: str, tiny_llama_dir):
    name, fields = CASES[case]
    torch.manual_seed(0)
    if name == "eagle3":  # num_layers shapes the module: built with it
        info = TargetInfo.load(tiny_llama_dir)
        drafter = Eagle3Drafter(Eagle3Config(target_layer_ids=[1, 2, 3], num_speculative_tokens=3,
                                             draft_vocab_size=64, **fields), info)
        drafter.prepare([])
        return info, drafter.train()
    info, drafter = small_drafter(name, tiny_llama_dir, None)
    for key, value in fields.items():
        setattr(drafter.cfg, key, value)  # read at step time
    return info, drafter.train()


@contextmanager
def rows_into(module):
    """The number of rows of each forward call of `module`, appended to the list yielded."""
    rows = []
    handle = module.register_forward_hook(lambda _module, args, _out: rows.append(args[0].shape[0]))
    try:
        yield rows
    finally:
        handle.remove()


def expected_context(batch, anchors_N, window) -> int:
    """Positions the DFlash read path keeps, counted plainly: per document with an anchor, from its first window's
    start to its last anchor."""
    kept = 0
    for d in batch.document_ids_T[anchors_N].unique().tolist():
        start = int(torch.nonzero(batch.document_ids_T == d)[0])
        mine = anchors_N[batch.document_ids_T[anchors_N] == d]
        lo = start if window is None else max(start, int(mine.min()) - window)
        kept += int(mine.max()) - lo + 1
    return kept


def heldout_anchors(batch) -> torch.Tensor:
    """Every third response position (none a document's first token), over all four rows."""
    return torch.nonzero(batch.loss_mask_T).squeeze(-1)[::3]


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
@pytest.mark.parametrize("case", list(CASES))
def test_read_equals_all_and_computes_fewer_rows(tiny_llama_dir, case, padded, monkeypatch):
    info, drafter = make_drafter(case, tiny_llama_dir)
    head = TargetHead(info)
    head.lm_head.weight.data *= 30  # a peaked target, as a trained one is: the metrics discriminate
    layer_ids = drafter.feature_spec().layer_ids
    samples = make_samples(info, layer_ids, LENGTHS, RESPONSE)
    eagle = drafter.name == "eagle3"
    watched = drafter.layers[-1].mlp if eagle else drafter.fc
    real_chunk_logits = chunked_logits._chunk_logits
    runs = {}
    for compute in ("all", "read"):
        drafter.compute = compute
        static = StaticShapes(tokens=PACK, pad=True) if padded else None
        batch = replace(pack(samples, layer_ids, pad_to=PACK if padded else None), static=static)
        formed = []  # per chunk of a vocabulary loss: whether it formed the target's logits from states itself
        monkeypatch.setattr(chunked_logits, "_chunk_logits",
                            lambda *a, seen=formed: (seen.append(a[2] is not None), real_chunk_logits(*a))[1])
        with rows_into(watched) as rows:
            out, grads = step_and_grads(drafter, head, batch)
        with torch.no_grad():
            anchors = heldout_anchors(batch)
            drafts = drafter.draft_logits(batch, head, anchors), drafter.propose(batch, head, anchors)
        runs[compute] = out, grads, rows, formed, drafts, static

    (out, grads, rows, formed, drafts, static), (r_out, r_grads, r_rows, r_formed, r_drafts, r_static) = runs.values()
    torch.testing.assert_close(r_out.loss, out.loss, rtol=RTOL, atol=0)
    for field in ("correct_K", "total_K", "accepted_prefix_sum", "blocks"):
        assert torch.equal(getattr(r_out, field), getattr(out, field)), field
    assert out.blocks > 0 and r_out.extra.keys() == out.extra.keys()
    for key, value in out.extra.items():
        assert r_out.extra[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    assert len(grads) >= 5 and r_grads.keys() == grads.keys()
    for key, grad in grads.items():
        assert relative_error(r_grads[key], grad) <= RTOL, key
    finite = torch.isfinite(drafts[0])  # EAGLE-3: -inf outside its draft vocabulary
    assert torch.equal(torch.isfinite(r_drafts[0]), finite) and finite.any()
    assert relative_error(r_drafts[0][finite], drafts[0][finite]) <= RTOL  # the held-out walk's path
    assert torch.equal(r_drafts[1], drafts[1])

    # What read skipped. EAGLE-3: step 0's last-layer MLP at the chains only (later steps: the chains in both).
    # DFlash family: fc at the positions some window reaches, counted plainly here.
    if eagle:
        pairs = drafter.pairs(batch)
        chains = drafter.unrolled_chains(drafter.chain_labels(batch, pairs)[1]).numel()
        assert rows[0] == pairs.t_S.numel() and r_rows[0] == chains < rows[0] // 3
        assert r_rows[1:] == rows[1:] == [chains] * (drafter.cfg.ttt_steps - 1)
    else:
        anchors_N = drafter.select_anchors(batch, torch.Generator().manual_seed(0))
        assert rows[0] == batch.num_tokens
        assert r_rows[0] == expected_context(batch, anchors_N, drafter.cfg.sliding_window) < sum(LENGTHS)
    if case in KEPT_LOGITS:  # all forms the target's logits in every chunk; read gathers them, formed once
        assert formed and all(formed) and r_formed and not any(r_formed)
    if padded:  # read gives a compiled kernel only shapes that all gives it (the context padded to the budget)
        assert static.seen and r_static.seen <= static.seen, (r_static.seen, static.seen)


def test_window_context_keeps_each_document_from_its_first_window_to_its_last_anchor():
    """Documents of 10, 6 and 8 tokens; anchors (unsorted) 7 and 5 in the first, none in the second, 20 in the
    third: window 3 keeps [2, 7] and [17, 20]; no window keeps [0, 7] and [16, 20]."""
    doc = torch.repeat_interleave(torch.arange(3), torch.tensor([10, 6, 8]))
    anchors = torch.tensor([7, 20, 5])
    assert window_context(doc, anchors, 3).tolist() == [2, 3, 4, 5, 6, 7, 17, 18, 19, 20]
    assert window_context(doc, anchors, None).tolist() == [*range(0, 8), *range(16, 21)]
    assert window_context(doc, torch.tensor([9, 15, 23]), None) is None  # every position read: no gather
    assert window_context(doc, torch.zeros(0, dtype=torch.long), 3) is None


@pytest.mark.parametrize("name", ["dflash", "dspark", "dflash2", "eagle3", "mtp"])
def test_vocabulary_gradient_formed_in_forward_equals_the_recomputing_backward(tiny_llama_dir, tmp_path, name,
                                                                                monkeypatch):
    """kernels/logits/chunked.py forms a frozen head's dloss/dh in the forward pass instead of recomputing the
    logits in backward: every drafter's loss, metrics and gradients equal the recomputing path's (fp32, rtol 1e-5),
    and a drafter whose vocabulary loss reads the frozen target lm_head really takes the in-forward path."""
    info, drafter = small_drafter(name, tiny_llama_dir, tmp_path)
    drafter.train()
    head = TargetHead(info)
    head.lm_head.weight.data *= 30
    layer_ids = drafter.feature_spec().layer_ids
    batch = pack(make_samples(info, layer_ids, LENGTHS, RESPONSE), layer_ids)
    real = chunked_logits.chunked_loss
    runs, fused_calls = {}, []
    for fused in (None, False):  # None: the default (in forward wherever the weight is frozen)
        def loss(*args, _fused=fused, **kwargs):
            rows = real(*args, **kwargs, grad_in_forward=_fused)
            fused_calls.append(_fused is None and not args[2].requires_grad)
            return rows
        for module in ("dflash", "dspark", "dflash2", "eagle3", "mtp"):
            monkeypatch.setattr(f"specdistill.drafters.{module}.chunked_loss", loss, raising=False)
        runs[fused] = step_and_grads(drafter, head, batch)
    (out, grads), (r_out, r_grads) = runs[None], runs[False]
    torch.testing.assert_close(out.loss, r_out.loss, rtol=RTOL, atol=0)
    for field in ("correct_K", "total_K", "accepted_prefix_sum", "blocks"):
        assert torch.equal(getattr(r_out, field), getattr(out, field)), field
    assert len(grads) >= 3 and grads.keys() == r_grads.keys()
    for key, grad in grads.items():
        assert relative_error(r_grads[key], grad) <= RTOL, key
    assert any(fused_calls) == (name != "dspark"), fused_calls  # DSpark trains part of its head's weight
