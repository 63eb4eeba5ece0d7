"""DFlash: attention mask semantics, D-PACE, training signal, and parity with speculators 0.9.0's classes."""

import json

import pytest
import torch

from bench.speculators_reference import all_anchors, load_reference
from specdistill.core.target import TargetHead, TargetInfo
from specdistill.drafters.dflash import DFlashConfig, DFlashDrafter, dpace_weights, spread_layer_ids
from specdistill.kernels.attention import anchor_block_mask
from tests.drafters.batches import make_batch
from tests.drafters.learnable import make_learnable, train_losses
from tests.drafters.parity import assert_same_loss_and_gradients, block_reference_inputs


def small_cfg(**kw) -> DFlashConfig:
    base = dict(num_layers=2, target_layer_ids=[1, 2, 3], sliding_window=None, max_anchors=64)
    return DFlashConfig(**{**base, **kw})


def test_mask_blocks_see_own_document_before_anchor_and_own_block_only():
    docs = torch.tensor([0, 0, 0, 0, 1, 1, 1])
    anchors = torch.tensor([2, 5])
    B = 2
    mask = anchor_block_mask(docs, anchors, B)
    ctx, blk = mask[:, :7], mask[:, 7:]
    assert ctx[0].tolist() == [True, True, False, False, False, False, False]  # strictly before 2, doc 0
    assert ctx[2].tolist() == [False, False, False, False, True, False, False]  # doc 1 before 5
    assert blk.tolist() == [[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 1, 1], [0, 0, 1, 1]]  # bidirectional, own block
    causal = anchor_block_mask(docs, anchors, B, causal_in_block=True)[:, 7:]
    assert causal.tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]]
    windowed = anchor_block_mask(torch.zeros(10, dtype=torch.long), torch.tensor([8]), 1, sliding_window=3)
    assert torch.nonzero(windowed[0, :10]).squeeze(-1).tolist() == [5, 6, 7]


def test_dpace_weights_match_speculators():
    from speculators.losses.utils import dpace_loss_decay

    g = torch.Generator().manual_seed(1)
    N, B = 5, 8
    ce = torch.rand(N, B, generator=g) * 3
    valid = torch.rand(N, B, generator=g) > 0.3
    ours = dpace_weights(ce, valid, 0.5)
    theirs = dpace_loss_decay(None, valid.reshape(1, -1).float(), B, 0.5, ce.reshape(1, -1)).reshape(N, B)
    torch.testing.assert_close(ours, theirs)


def test_spread_layer_ids_stays_in_range():
    assert spread_layer_ids(40, 5) == [2, 11, 20, 29, 38]
    assert spread_layer_ids(4, 5) == [1, 2, 3]  # clipped to what a 4-layer target has


def test_label_positions_stop_at_document_end(tiny_llama_dir):
    info = TargetInfo.load(tiny_llama_dir)
    drafter = DFlashDrafter(small_cfg(block_size=4), info, mask_token_id=3)
    batch = make_batch(info, [1, 2, 3, 4])
    anchors = torch.tensor([19, 18, 33])  # last response token of doc 0, one before it, last of the pack
    _, valid = drafter.label_positions(batch, anchors)
    assert valid.tolist() == [[False] * 3, [True, False, False], [False] * 3]


def test_training_step_learns(tiny_llama_dir):
    """On a learnable stream (each token fixes the next; states are a function of the token) the loss falls."""
    torch.manual_seed(0)
    info = TargetInfo.load(tiny_llama_dir)
    head = TargetHead(info)
    head.lm_head.weight.data *= 30  # HF's std-0.02 init gives near-flat logits a trained target never has
    # Uniform weights: D-PACE weights grow as the drafter improves, so its loss is no progress measure.
    drafter = DFlashDrafter(small_cfg(loss_weighting="uniform"), info, mask_token_id=3)
    batch = make_batch(info, drafter.feature_spec().layer_ids)
    make_learnable(batch, info)
    losses, out = train_losses(drafter, batch, head, 40)
    assert losses[-1] < 0.3 * losses[0], losses
    assert out.correct_K.sum() > 0.5 * out.total_K.sum()


def _drafter_and_reference(info: TargetInfo, head: TargetHead, tmp_path, **cfg):
    """A 2-layer drafter (norms away from 1 so a convention mix-up would show), exported and loaded back by
    speculators 0.9.0's own DFlashDraftModel (fp32, eager attention)."""
    from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig

    torch.manual_seed(0)
    drafter = DFlashDrafter(small_cfg(**cfg), info, mask_token_id=3)
    for p in drafter.parameters():
        if p.ndim == 1:
            p.data.uniform_(0.5, 1.5)
    drafter.export(tmp_path, info)
    return drafter, load_reference(DFlashDraftModel, DFlashSpeculatorConfig, tmp_path, head)


@pytest.mark.parametrize("causal_in_block", [False, True])
def test_export_matches_speculators_reference(tiny_llama_dir, tmp_path, causal_in_block):
    """Our export, loaded by speculators' own DFlashDraftModel, gives the same logits (fp32, 1e-4)."""
    info = TargetInfo.load(tiny_llama_dir)
    head = TargetHead(info)
    drafter, ref = _drafter_and_reference(info, head, tmp_path, causal_in_block=causal_in_block,
                                          sliding_window=16 if causal_in_block else None)
    ref.eval()
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["sliding_window_non_causal"] is (not causal_in_block)
    batch = make_batch(info, drafter.feature_spec().layer_ids)
    torch.manual_seed(7)
    anchors, n_valid = all_anchors(batch, drafter.block_size)
    torch.manual_seed(7)  # same anchors inside the reference
    with torch.no_grad():
        _, ref_logits, _, _, _ = ref._backbone_forward(*block_reference_inputs(batch, drafter, info),
                                                       max_anchors=n_valid)
        ours = head.lm_head(drafter.block_hidden(batch, head, anchors)).reshape(1, -1, info.vocab_size)
    assert (ours - ref_logits).abs().max() <= 1e-4


@pytest.mark.parametrize("loss,weighting", [("ce", "dpace"), ("kl", "exp_decay")])
def test_loss_and_gradients_match_speculators(tiny_llama_dir, tmp_path, loss, weighting):
    """block_loss and every gradient equal speculators' DFlashDraftModel forward (its eager ce / kl_div loss,
    D-PACE / fixed-exp-decay weights) on the same weights, batch and anchors (fp32, 1e-5 relative)."""
    from speculators.losses import resolve_loss_config

    info = TargetInfo.load(tiny_llama_dir)
    head = TargetHead(info)
    head.lm_head.weight.data *= 30  # a peaked target, as a trained one is (and argmax labels without ties)
    drafter, ref = _drafter_and_reference(info, head, tmp_path, loss=loss, loss_weighting=weighting)
    for lm_head in (ref.lm_head, ref.verifier_lm_head):  # DFlash drafts through the target's own lm_head
        lm_head.weight.data.copy_(head.lm_head.weight)
    # Prompts longer than a block: speculators' loss mask has no document check, so no loss-carrying block
    # may run into the next document's response for the two losses to agree.
    batch = make_batch(info, drafter.feature_spec().layer_ids, lengths=(26, 22), prompt=(9, 9))
    anchors, n_valid = all_anchors(batch, drafter.block_size)
    out = drafter.block_loss(batch, head, anchors)
    _, ref_loss, _ = ref(*block_reference_inputs(batch, drafter, info), max_anchors=n_valid,
                         loss_config=resolve_loss_config({"ce": "ce", "kl": "kl_div"}[loss], "eager"),
                         per_position_loss_weight={"dpace": "dpace", "exp_decay": "fixed-exp-decay"}[weighting],
                         gamma=drafter.cfg.decay_gamma, dpace_alpha=drafter.cfg.dpace_alpha)
    # fc, hidden_norm, both layers' projections and norms, the final norm
    assert_same_loss_and_gradients(drafter, out.loss, ref, ref_loss, min_params=12)


def test_mask_token_is_chosen_when_the_configured_one_is_missing():
    from specdistill.drafters.base import choose_mask_token
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"a": 0, "b": 1, "<pad>": 2, "</s>": 3}
    raw = Tokenizer(models.WordLevel(vocab, unk_token=None))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<pad>", eos_token="</s>")
    assert choose_mask_token(tok, 4, "b", "drafter.mask_token") == (1, "drafter.mask_token='b'")
    # no such token: an embedding row past the tokenizer's vocabulary, which it never emits
    assert choose_mask_token(tok, 8, "<|mask|>", "drafter.mask_token")[0] == 4
    # no spare row: the pad token (it is not eos)
    assert choose_mask_token(tok, 4, "<|mask|>", "drafter.mask_token") == (2, "the pad token '<pad>'")
    tok.pad_token = "</s>"  # pad is eos: the last id
    token_id, why = choose_mask_token(tok, 4, "<|mask|>", "drafter.mask_token")
    assert token_id == 3 and "no spare token" in why
