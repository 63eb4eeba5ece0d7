"""feature_server.positions=read ships only what the run's drafters read (core/contract.py): on the same rows and the
same anchors every drafter's loss, metrics and gradients equal those on whole rows (positions=all), fp32, rtol 1e-5:
rows whose first response token lies beyond the window and within it, several rows per pack, padded packs, a run
mixing a windowed and a full-attention drafter, the held-out walk and the baselines."""

from dataclasses import replace

import pytest
import torch

from specdistill.core.batch import pack, shipped_tokens
from specdistill.core.contract import FeatureSample, FeatureSpec
from specdistill.core.rows import as_rows
from specdistill.core.shapes import StaticShapes
from specdistill.core.target import TargetHead
from specdistill.core.contract import TokenizedRow
from specdistill.evaluation.acceptance import evaluate_report, target_row
from tests.drafters.batches import small_drafter

WINDOW = 10  # rows 0 and 1 start their response past it (their context is cut), row 2 within it (unchanged)
LENGTHS, RESPONSES = (40, 36, 12), (12, 10, 6)
PACK = 128


def _samples(info, layer_ids) -> list[FeatureSample]:
    """Whole-row samples of `layer_ids`: a prompt, then a response to the row's end."""
    g = torch.Generator().manual_seed(0)
    return [FeatureSample(row_id=i, input_ids_T=torch.randint(0, info.vocab_size, (n,), generator=g),
                          loss_mask_T=torch.arange(n) >= n - r,
                          hidden_TLD=torch.randn(n, len(layer_ids), info.hidden_size, generator=g))
            for i, (n, r) in enumerate(zip(LENGTHS, RESPONSES))]


def _drafter(name, tiny_llama_dir, tmp_path, window=WINDOW, **overrides):
    info, drafter = small_drafter(name, tiny_llama_dir, tmp_path)
    if hasattr(drafter.cfg, "sliding_window"):
        drafter.cfg = replace(drafter.cfg, sliding_window=window, **overrides)
    drafter.train()
    return info, drafter


def _step(drafter, head, batch, anchors=None):
    drafter.zero_grad(set_to_none=True)
    if anchors is None:
        out = drafter(batch, head, torch.Generator().manual_seed(0))
    else:
        out = drafter.block_loss(batch, head, anchors)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}


def _assert_same(a, b):
    (out_a, grads_a), (out_b, grads_b) = a, b
    torch.testing.assert_close(out_a.loss, out_b.loss, rtol=1e-5, atol=1e-7)
    for field in ("correct_K", "total_K", "accepted_prefix_sum", "blocks"):
        assert torch.equal(getattr(out_a, field), getattr(out_b, field)), field
    assert out_a.extra.keys() == out_b.extra.keys()
    for key in out_a.extra:
        assert out_a.extra[key] == pytest.approx(out_b.extra[key], rel=1e-5, abs=1e-7), key
    assert grads_a and grads_a.keys() == grads_b.keys()
    for key, grad in grads_a.items():
        torch.testing.assert_close(grad, grads_b[key], rtol=1e-5, atol=1e-7, msg=key)


def _specs(drafters):
    specs = [d.feature_spec() for d in drafters]
    return (FeatureSpec.union(specs, "float32", "read"), FeatureSpec.union(specs, "float32", "all"))


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
@pytest.mark.parametrize("name", ["dflash", "dspark", "dflash2", "eagle3", "mtp"])
def test_each_drafter_trains_alike_on_what_ships_and_on_whole_rows(tiny_llama_dir, tmp_path, name, padded):
    torch.manual_seed(0)
    # max_anchors below the candidates: anchors are sampled, and the same ones must be sampled both ways
    info, drafter = _drafter(name, tiny_llama_dir, tmp_path, max_anchors=16) if name != "eagle3" and name != "mtp" \
        else _drafter(name, tiny_llama_dir, tmp_path)
    head = TargetHead(info)
    read, whole = _specs([drafter])
    samples = _samples(info, whole.layer_ids)
    kw = lambda: {"pad_to": PACK} if padded else {}  # noqa: E731
    batch_read, batch_all = pack(samples, read, **kw()), pack(samples, whole, **kw())
    if padded:
        batch_read = replace(batch_read, static=StaticShapes(tokens=PACK, pad=True))
        batch_all = replace(batch_all, static=StaticShapes(tokens=PACK, pad=True))
    windowed = read.context_window is not None
    if windowed:  # what was cut: rows 0 and 1 start WINDOW before their response, row 2 whole
        assert batch_read.num_real_tokens == (WINDOW + 12) + (WINDOW + 10) + 12 < batch_all.num_real_tokens
        assert batch_read.position_ids_T[0] == 40 - 12 - WINDOW  # a row keeps its own positions
    if name != "mtp":  # the last layer ships at the response positions (and the one before) only
        assert read.response_layer_ids == (info.num_hidden_layers,)
        assert batch_read.num_response_positions == sum(r + 1 for r in RESPONSES)
    else:
        assert read == whole  # MTP reads the last layer everywhere
    _assert_same(_step(drafter, head, batch_read), _step(drafter, head, batch_all))


@pytest.mark.parametrize("name", ["dflash", "dspark", "dflash2"])
def test_the_same_anchors_give_the_same_blocks(tiny_llama_dir, tmp_path, name):
    """Every response position as an anchor (block_loss), mapped between the two layouts."""
    info, drafter = _drafter(name, tiny_llama_dir, tmp_path)
    head = TargetHead(info)
    read, whole = _specs([drafter])
    samples = _samples(info, whole.layer_ids)
    batch_read, batch_all = pack(samples, read), pack(samples, whole)
    anchors_read = torch.nonzero(batch_read.loss_mask_T).squeeze(-1)
    anchors_all = torch.nonzero(batch_all.loss_mask_T).squeeze(-1)
    assert torch.equal(batch_read.position_ids_T[anchors_read], batch_all.position_ids_T[anchors_all])
    _assert_same(_step(drafter, head, batch_read, anchors_read), _step(drafter, head, batch_all, anchors_all))


def test_a_windowed_and_a_full_attention_drafter_share_one_stream(tiny_llama_dir, tmp_path):
    """[dflash (windowed), eagle3]: whole rows for the context layers, the last layer at response positions; each
    drafter trains on it as on whole rows."""
    info, dflash = _drafter("dflash", tiny_llama_dir, tmp_path)
    _, eagle3 = _drafter("eagle3", tiny_llama_dir, tmp_path)
    head = TargetHead(info)
    read, whole = _specs([dflash, eagle3])
    assert read.context_window is None and read.response_layer_ids == (info.num_hidden_layers,)
    samples = _samples(info, whole.layer_ids)
    batch_read, batch_all = pack(samples, read), pack(samples, whole)
    assert batch_read.num_real_tokens == batch_all.num_real_tokens == sum(LENGTHS)
    for drafter in (dflash, eagle3):
        _assert_same(_step(drafter, head, batch_read), _step(drafter, head, batch_all))


@pytest.mark.parametrize("name", ["dflash", "eagle3"])
def test_the_heldout_walk_and_the_baselines_read_the_same(tiny_llama_dir, tmp_path, name):
    info, drafter = _drafter(name, tiny_llama_dir, tmp_path)
    drafter.eval()
    head = TargetHead(info)
    read, whole = _specs([drafter])
    samples = _samples(info, whole.layer_ids)
    shipped = [s.shipped(read) for s in samples]
    for static in (None, StaticShapes(tokens=PACK, pad=True)):
        on_read = evaluate_report(drafter, head, shipped, read, torch.device("cpu"), torch.float32, static=static)
        on_all = evaluate_report(drafter, head, samples, whole, torch.device("cpu"), torch.float32, static=static)
        assert on_read.to_dict() == on_all.to_dict() and on_read.total.num_drafts > 0
    # The baselines walk the whole row's tokens (the n-gram searches the whole prompt), the target's own greedy
    # tokens in the response
    for cut, full in zip(shipped, samples):
        assert target_row(cut, read, head) == target_row(full, whole, head)
        assert len(target_row(cut, read, head)) == full.num_tokens


def test_the_planner_packs_by_what_ships():
    """A windowed-only run's rows ship from WINDOW before their first response token: more rows fit a pack."""
    rows = as_rows([TokenizedRow(i, tuple(range(n)), tuple(int(j >= n - r) for j in range(n)))
                    for i, (n, r) in enumerate(zip(LENGTHS, RESPONSES))])
    read = FeatureSpec((1, 4), context_window=WINDOW, response_layer_ids=(4,))
    assert shipped_tokens(rows, read).tolist() == [WINDOW + 12, WINDOW + 10, 12]
    assert shipped_tokens(rows, FeatureSpec((1, 4))).tolist() == list(LENGTHS)


def test_a_reader_outside_the_declared_positions_gets_an_error(tiny_llama_dir, tmp_path):
    info, drafter = _drafter("dflash", tiny_llama_dir, tmp_path)
    read, whole = _specs([drafter])
    batch = pack(_samples(info, whole.layer_ids), read)
    L = info.num_hidden_layers
    with pytest.raises(IndexError, match="ships only from each row's first response token - 1"):
        batch.layer_at(L, torch.tensor([0]))
    with pytest.raises(KeyError, match="ship only at response positions"):
        batch.layers([L])
