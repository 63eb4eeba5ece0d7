"""DFlash 2: the convolution (identity at init, inside blocks only), selector labels, the greedy selector walk,
training signal, and parity with speculators 0.9.0's DFlash2DraftModel (logits, selector scores, loss)."""

import json

import pytest
import torch

from bench.speculators_reference import all_anchors, load_reference
from specdistill.core.target import TargetHead, TargetInfo
from specdistill.drafters.dflash import DFlashDrafter
from specdistill.drafters.dflash2 import (CandidateSelector, DFlash2Config, DFlash2Drafter, GroupedDynamicCausalConv,
                                         chunked_topk, grouped_dynamic_conv, selector_training_candidates)
from tests.drafters.batches import make_batch
from tests.drafters.learnable import make_learnable, train_losses
from tests.drafters.parity import assert_same_loss_and_gradients, block_reference_inputs


def small_cfg(**kw) -> DFlash2Config:
    base = dict(num_layers=2, target_layer_ids=[1, 2, 3], sliding_window=None, max_anchors=64, selector_rank=16)
    return DFlash2Config(**{**base, **kw})


def randomize_convs(drafter: DFlash2Drafter, std: float = 0.3) -> None:
    for name, p in drafter.named_parameters():
        if "_conv." in name:
            p.data.normal_(0, std)


def test_conv_is_identity_at_init(tiny_llama_dir):
    """A fresh DFlash 2 backbone equals DFlash with the same weights: both convolutions start as identities."""
    torch.manual_seed(0)
    conv = GroupedDynamicCausalConv(64, block_size=4, kernel_size=2, group_size=16)
    x = torch.randn(12, 64)
    y, delta = conv.prepare(x)
    assert torch.equal(y, x) and torch.equal(conv.finish(x, delta), x)
    info = TargetInfo.load(tiny_llama_dir)
    head = TargetHead(info)
    ours = DFlash2Drafter(small_cfg(), info, mask_token_id=3)
    plain = DFlashDrafter(small_cfg(name="dflash"), info, mask_token_id=3)
    missing, unexpected = plain.load_state_dict(ours.state_dict(), strict=False)
    assert not missing and all("_conv." in k or k.startswith("candidate_selector.") for k in unexpected)
    batch = make_batch(info, ours.feature_spec().layer_ids)
    anchors = torch.tensor([9, 12, 27])
    torch.testing.assert_close(ours.block_hidden(batch, head, anchors), plain.block_hidden(batch, head, anchors))


def test_conv_stays_inside_its_block():
    """Kernel 2: a change at slot j reaches slots j and j+1 of its own block only, never the next block."""
    from speculators.models.dflash2.model_definitions import grouped_dynamic_conv as reference

    torch.manual_seed(0)
    B, N, D, gs = 4, 3, 32, 8
    x = torch.randn(N * B, D)
    delta = torch.randn(N * B, 2, D // gs)
    base = torch.randn(2, D)
    y = grouped_dynamic_conv(x, delta, base, B, gs)
    torch.testing.assert_close(y, reference(x, delta, base, block_size=B, group_size=gs))
    for j in range(N * B):
        bumped = x.clone()
        bumped[j] += 1.0
        changed = (grouped_dynamic_conv(bumped, delta, base, B, gs) - y).abs().sum(-1) > 0
        expected = {j} | ({j + 1} if (j + 1) % B else set())  # the next slot, unless it opens a new block
        assert set(torch.nonzero(changed).squeeze(-1).tolist()) == expected, j


def test_selector_label_inserted_in_place_of_weakest_candidate():
    from speculators.models.dflash2.metrics import selector_training_candidates as reference

    candidates = torch.tensor([[5, 3, 9], [1, 2, 4], [8, 6, 0]])
    target = torch.tensor([3, 7, 0])  # present at rank 1; missing; present at the weakest rank
    training, label, contains = selector_training_candidates(candidates, target)
    assert training.tolist() == [[5, 3, 9], [1, 2, 7], [8, 6, 0]]
    assert label.tolist() == [1, 2, 2] and contains.tolist() == [True, False, True]
    for ours, theirs in zip((training, label, contains), reference(candidates, target)):
        assert torch.equal(ours, theirs)


def test_propose_is_the_selectors_greedy_walk(tiny_llama_dir):
    """Each draft is the best of the slot's top-16 given the draft before it (the anchor for the first):
    teacher-forcing the drafts back in, the selector picks the drafts again."""
    torch.manual_seed(0)
    info = TargetInfo.load(tiny_llama_dir)
    head = TargetHead(info)
    drafter = DFlash2Drafter(small_cfg(), info, mask_token_id=3).eval()
    randomize_convs(drafter)
    drafter.candidate_selector.predecessor_codebook.data.normal_(0, 3.0)  # edges strong enough to matter
    drafter.candidate_selector.successor_codebook.data.normal_(0, 3.0)
    batch = make_batch(info, drafter.feature_spec().layer_ids)
    anchor = torch.tensor([9])
    drafts = drafter.propose(batch, head, anchor)
    K = drafter.num_speculative_tokens
    assert drafts.shape == (1, K)
    hidden = drafter.block_hidden(batch, head, anchor)[0, 1:]
    _, candidates = chunked_topk(hidden, head.lm_head.weight, 16)
    assert not torch.equal(drafts[0], candidates[:, 0]), "the selector should overrule the unary argmax here"
    prev = torch.cat([batch.input_ids_T[anchor], drafts[0, :-1]])
    with torch.no_grad():
        scores = drafter.selector_scores(hidden, prev, candidates, head)
    assert torch.equal(candidates.gather(1, scores.argmax(-1, keepdim=True))[:, 0], drafts[0])


def test_selector_gradients_are_the_same_run_to_run_on_several_threads():
    """The codebooks' gradients sum the rows that share a token id. Indexing (codebook[ids]) sums them on CPU with
    atomic adds from each thread in whatever order the threads run (index_put_ with accumulate, 2 threads or more,
    32k elements or more), which left two dflash2 runs of one seed 6.4e-7 apart (docs/launching.md); F.embedding's
    backward sums each token's rows in one order."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        torch.manual_seed(0)
        selector = CandidateSelector(vocab_size=64, hidden=32, rank=256, top_k=16)
        hidden = torch.randn(1024, 32)
        prev, candidates = torch.randint(0, 4, (1024,)), torch.randint(0, 4, (1024, 16))  # ids shared by many rows
        weight = torch.randn(1024, 16)
        grads = []
        for _ in range(10):
            selector.zero_grad()
            (selector.transition_scores(hidden, prev, candidates) * weight).sum().backward()
            grads.append([p.grad.clone() for p in (selector.predecessor_codebook, selector.successor_codebook)])
        assert all(torch.equal(a, b) for g in grads[1:] for a, b in zip(g, grads[0]))
    finally:
        torch.set_num_threads(threads)


def test_training_step_learns(tiny_llama_dir):
    """On a learnable stream (each token fixes the next; states are a function of the token) the loss falls."""
    torch.manual_seed(0)
    info = TargetInfo.load(tiny_llama_dir)
    head = TargetHead(info)
    head.lm_head.weight.data *= 30  # HF's std-0.02 init gives near-flat logits a trained target never has
    drafter = DFlash2Drafter(small_cfg(), info, mask_token_id=3)
    batch = make_batch(info, drafter.feature_spec().layer_ids)
    make_learnable(batch, info)
    losses, out = train_losses(drafter, batch, head, 40)
    assert losses[-1] < 0.3 * losses[0], losses
    assert out.correct_K.sum() > 0.5 * out.total_K.sum()
    assert out.extra["candidate_recall"] > 0.9


def test_export_matches_speculators_reference(tiny_llama_dir, tmp_path):
    """Our export, loaded by speculators' own DFlash2DraftModel: same logits through non-identity convolutions,
    same selector scores (fp32, 1e-4), and the same loss and gradients from their forward (eager KL; 1e-5
    relative)."""
    from speculators.losses import resolve_loss_config
    from speculators.models.dflash2 import DFlash2DraftModel, DFlash2SpeculatorConfig
    from speculators.models.dflash2.metrics import selector_training_candidates as ref_candidates

    torch.manual_seed(0)
    info = TargetInfo.load(tiny_llama_dir)
    head = TargetHead(info)
    drafter = DFlash2Drafter(small_cfg(), info, mask_token_id=3)
    for p in drafter.parameters():  # norms away from 1 so a convention mix-up would show
        if p.ndim == 1:
            p.data.uniform_(0.5, 1.5)
    randomize_convs(drafter)
    drafter.export(tmp_path, info)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["speculators_model_type"] == "dflash2" and config["sample_from_anchor"] is False
    assert (config["conv_kernel_size"], config["selector_top_k"]) == (2, 16)

    ref = load_reference(DFlash2DraftModel, DFlash2SpeculatorConfig, tmp_path, head).eval()
    torch.testing.assert_close(ref.layers[1].mlp_conv.base_kernel, drafter.layers[1].mlp_conv.base_kernel)
    # Prompts longer than a block: speculators' loss mask has no document check (see test_dspark).
    batch = make_batch(info, drafter.feature_spec().layer_ids, lengths=(26, 22), prompt=(9, 9))
    B = drafter.block_size
    anchors, n_valid = all_anchors(batch, B)
    inputs = block_reference_inputs(batch, drafter, info)
    with torch.no_grad():
        hidden, logits, targets, _, block_idx = ref._backbone_forward(*inputs, max_anchors=n_valid)
        ours_hidden = drafter.block_hidden(batch, head, anchors).reshape(1, -1, info.hidden_size)
        assert (head.lm_head(ours_hidden) - logits).abs().max() <= 1e-4
        prev = ref._predecessor_ids(batch.input_ids_T[None], block_idx).reshape(1, -1)
        candidates, _, _ = ref_candidates(logits.topk(16, -1).indices, targets.argmax(-1))
        ref_scores = ref.candidate_selector.score_candidates(logits, hidden, prev, candidates)
        ours = drafter.selector_scores(ours_hidden[0], prev[0], candidates[0], head)
        assert (ours - ref_scores[0]).abs().max() <= 1e-4
    ref.train()
    eager_tv = resolve_loss_config("tv", "eager")["tv"][0]  # their fused default needs Triton
    _, ref_loss, _ = ref(*inputs, loss_config=resolve_loss_config("kl_div", "eager"), tv_loss_fn=eager_tv,
                         max_anchors=n_valid)
    out = drafter.block_loss(batch, head, anchors)
    # fc, hidden_norm, both layers (convolutions included), the final norm, the candidate selector
    assert_same_loss_and_gradients(drafter, out.loss, ref, ref_loss, min_params=14)


@pytest.mark.gpu
@pytest.mark.vllm
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="vLLM 0.32 serves DFlash 2 only on Model Runner V2 (GPU, Triton); on CPU Model Runner V1 "
                           "rejects it ('Model Runner V1 does not support: DFlash candidate-head drafts'), so CPU "
                           "parity is checked against speculators' DFlash2DraftModel above")
def test_vllm_serves_trained_export(tmp_path, cache_dir, tiny_target, target_alone_runs):
    """A trained DFlash 2 export served by vLLM (method dflash, architecture DFlash2DraftModel): lossless greedy,
    accepted as the offline walk predicts."""
    from tests.serving_helpers import serve_trained_export

    serve_trained_export(tmp_path, cache_dir, tiny_target, target_alone_runs, "dflash2", "dflash")
