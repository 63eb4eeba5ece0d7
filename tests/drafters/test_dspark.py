"""DSpark: slot alignment (sample_from_anchor), sequential Markov drafting, training signal, and parity with
speculators 0.9.0's DSparkDraftModel (logits, Markov bias, confidence head and the loss itself)."""

import json

import pytest
import torch

from bench.speculators_reference import all_anchors, load_reference
from specdistill.core.target import TargetHead, TargetInfo
from specdistill.drafters.dspark import DSparkConfig, DSparkDrafter
from tests.drafters.batches import make_batch
from tests.drafters.learnable import make_learnable, train_losses
from tests.drafters.parity import assert_same_loss_and_gradients, block_reference_inputs


def small_cfg(**kw) -> DSparkConfig:
    base = dict(num_layers=2, target_layer_ids=[1, 2, 3], sliding_window=None, max_anchors=64, markov_rank=16)
    return DSparkConfig(**{**base, **kw})


def test_every_slot_drafts_the_next_token(tiny_llama_dir):
    """sample_from_anchor: K = B; slot k at p+k learns the target's state at p+k and counts if p+k is a response
    token of the anchor's document (speculators' aligned loss mask)."""
    info = TargetInfo.load(tiny_llama_dir)
    drafter = DSparkDrafter(small_cfg(block_size=4), info, mask_token_id=3)
    assert drafter.num_speculative_tokens == 4
    batch = make_batch(info, [1, 2, 3, 4])  # docs of 20 and 14 tokens, responses from 8 and 26
    valid, state, prev = drafter.draft_rows(batch, torch.tensor([17, 19, 33]))
    assert valid.tolist() == [[True, True, True, False], [True, False, False, False], [True, False, False, False]]
    assert state[0].tolist() == [17, 18, 19, 20]
    assert prev[0].tolist() == batch.input_ids_T[17:21].tolist()  # slot 0 follows the anchor token itself
    dflash_layout = DSparkDrafter(small_cfg(block_size=4, sample_from_anchor=False), info, mask_token_id=3)
    assert dflash_layout.num_speculative_tokens == 3
    valid, state, prev = dflash_layout.draft_rows(batch, torch.tensor([17]))
    assert valid.tolist() == [[True, True, False]] and state.tolist() == [[17, 18, 19]]
    assert prev[0].tolist() == batch.input_ids_T[[17, 17, 18, 19]].tolist()


@pytest.mark.parametrize("head_type", ["vanilla", "rnn"])
def test_propose_is_sequential_through_the_markov_bias(tiny_llama_dir, head_type):
    """Each drafted token is the argmax given the tokens drafted before it: teacher-forcing the drafts back
    in gives the drafts again (the backbone sees only the anchor and context, so its states do not move)."""
    torch.manual_seed(0)
    info = TargetInfo.load(tiny_llama_dir)
    head = TargetHead(info)
    # Fresh layers: copied from the random target's top layers, the block logits dwarf the Markov bias.
    drafter = DSparkDrafter(small_cfg(markov_head_type=head_type, init_from_target=False), info,
                            mask_token_id=3).eval()
    drafter.markov_head.markov_w1.weight.data.normal_(0, 3.0)  # a bias strong enough to change the argmax
    batch = make_batch(info, drafter.feature_spec().layer_ids)
    anchor = torch.tensor([9])
    drafts = drafter.propose(batch, head, anchor)
    assert drafts.shape == (1, drafter.block_size)
    base = head.lm_head(drafter.block_hidden(batch, head, anchor)).argmax(-1)
    assert not torch.equal(drafts, base), "the Markov bias should matter here"
    batch.input_ids_T[10:10 + drafter.block_size - 1] = drafts[0, :-1]
    logits, _ = drafter.block_logits(batch, head, anchor)
    assert torch.equal(logits.argmax(-1), drafts)


def test_training_step_learns(tiny_llama_dir):
    """On a learnable stream (each token fixes the next; states are a function of the token) the loss falls."""
    torch.manual_seed(0)
    info = TargetInfo.load(tiny_llama_dir)
    head = TargetHead(info)
    head.lm_head.weight.data *= 30  # HF's std-0.02 init gives near-flat logits a trained target never has
    drafter = DSparkDrafter(small_cfg(), info, mask_token_id=3)
    batch = make_batch(info, drafter.feature_spec().layer_ids)
    make_learnable(batch, info)
    losses, out = train_losses(drafter, batch, head, 40)
    assert losses[-1] < 0.3 * losses[0], losses
    assert out.correct_K.sum() > 0.5 * out.total_K.sum()
    assert out.extra["confidence_abs_error"] < 0.3  # the confidence head tracks 1 - TV


@pytest.mark.parametrize("head_type", ["vanilla", "gated", "rnn"])
def test_export_matches_speculators_reference(tiny_llama_dir, tmp_path, head_type):
    """Our export, loaded by speculators' own DSparkDraftModel: same Markov-corrected logits and confidence
    logits (fp32, 1e-4), and the same loss and gradients from their forward (eager KL / TV; 1e-5 relative)."""
    from speculators.losses import resolve_loss_config
    from speculators.models.dspark import DSparkDraftModel, DSparkSpeculatorConfig

    torch.manual_seed(0)
    info = TargetInfo.load(tiny_llama_dir)
    head = TargetHead(info)
    drafter = DSparkDrafter(small_cfg(markov_head_type=head_type), info, mask_token_id=3)
    for p in drafter.parameters():  # norms away from 1 so a convention mix-up would show
        if p.ndim == 1:
            p.data.uniform_(0.5, 1.5)
    drafter.markov_head.markov_w1.weight.data.normal_(0, 0.5)  # a bias that is not negligible
    drafter.export(tmp_path, info)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["speculators_model_type"] == "dspark" and config["sample_from_anchor"] is True
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == drafter.block_size

    ref = load_reference(DSparkDraftModel, DSparkSpeculatorConfig, tmp_path, head).eval()
    assert ref.markov_head.head_type == head_type
    # Prompts longer than a block: speculators' loss mask has no document check, so no loss-carrying block
    # may run into the next document's response for the two losses to agree.
    batch = make_batch(info, drafter.feature_spec().layer_ids, lengths=(26, 22), prompt=(9, 9))
    B, D = drafter.block_size, info.hidden_size
    anchors, n_valid = all_anchors(batch, B)
    inputs = block_reference_inputs(batch, drafter, info)
    with torch.no_grad():
        hidden, logits, _, _, block_idx = ref._backbone_forward(*inputs, max_anchors=n_valid)
        prev = batch.input_ids_T[block_idx].view(-1, B)
        emb = ref.markov_head.prev_embeddings(prev)
        hidden = hidden.view(-1, B, D)
        ref_logits = logits.view(-1, B, info.vocab_size) + ref.markov_head.block_bias(
            prev_token_ids=prev, hidden_states=hidden, prev_emb=emb)
        ref_conf = ref.confidence_head(torch.cat([hidden, emb], -1))
        ours, conf = drafter.block_logits(batch, head, anchors)
        assert (ours - ref_logits).abs().max() <= 1e-4
        assert (conf - ref_conf).abs().max() <= 1e-4
    ref.train()
    eager_tv = resolve_loss_config("tv", "eager")["tv"][0]
    _, ref_loss, metrics = ref(*inputs, loss_config=resolve_loss_config("kl_div", "eager"), tv_loss_fn=eager_tv,
                               max_anchors=n_valid)
    out = drafter.block_loss(batch, head, anchors)
    confidence = out.extra["confidence_loss"]
    assert abs(confidence - float(metrics["confidence_loss_sum"])) <= 1e-5 * confidence
    # fc, hidden_norm, both layers, the final norm, the Markov head and the confidence head
    assert_same_loss_and_gradients(drafter, out.loss, ref, ref_loss, min_params=14)


@pytest.mark.gpu
@pytest.mark.vllm
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="vLLM 0.32 serves DSpark only on Model Runner V2 (GPU, Triton); on CPU Model Runner V1 "
                           "rejects it ('Model Runner V1 does not support: dspark speculative decoding'), so CPU "
                           "parity is checked against speculators' DSparkDraftModel above")
def test_vllm_serves_trained_export(tmp_path, cache_dir, tiny_target, target_alone_runs):
    """A trained DSpark export of tiny-llama served by vLLM (method dspark): greedy outputs equal the base, drafts
    accepted as the offline walk predicts."""
    from tests.serving_helpers import serve_trained_export

    serve_trained_export(tmp_path, cache_dir, tiny_target, target_alone_runs, "dspark", "dspark")
