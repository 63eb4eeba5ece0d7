"""EAGLE-3: draft vocabulary, layer ids, training signal, parity with speculators 0.9.0's Eagle3DraftModel, and a
trained export served by vLLM (lossless; acceptance counters equal to our offline walk)."""

import json
import shutil

import pytest
import torch

from bench.speculators_reference import load_reference
from specdistill.core.batch import PackedBatch
from specdistill.core.contract import TokenizedRow
from specdistill.core.run_dir import RunDir
from specdistill.core.target import TargetHead, TargetInfo
from specdistill.drafters.eagle3 import (Eagle3Config, Eagle3Drafter, build_draft_vocab, default_layer_ids,
                             speculators_loss_mask)
from tests.drafters.batches import make_batch
from tests.drafters.learnable import make_learnable, train_losses
from tests.drafters.parity import assert_same_loss_and_gradients


def test_default_layer_ids_follow_vllm_and_clip_for_shallow_targets():
    assert default_layer_ids(32) == [2, 16, 29]  # vLLM's get_eagle3_default_aux_hidden_state_layers
    assert default_layer_ids(4) == [1, 2, 3]  # (2, 2, 1) would be deduplicated by vLLM into 2 states


def test_draft_vocab_frequency_order_padding_and_mappings(tiny_llama_dir):
    rows = [TokenizedRow(0, (9, 5, 5, 7, 7, 7), (0, 1, 1, 1, 1, 1)),  # 9 is prompt-only: never counted
            TokenizedRow(1, (3, 7, 5, 200), (0, 1, 1, 1))]
    # counts: 7 x4, 5 x3, 200 x1 -> top 2 = {7, 5}; ties would go to the lower id
    assert build_draft_vocab(rows, 2).tolist() == [5, 7]
    # fewer distinct than the limit: all of them, padded with the lowest unused ids, sorted
    assert build_draft_vocab(rows, 5).tolist() == [0, 1, 5, 7, 200]
    assert build_draft_vocab(rows, 5).tolist() == build_draft_vocab(list(rows), 5).tolist()  # deterministic

    info = TargetInfo.load(tiny_llama_dir)
    drafter = Eagle3Drafter(Eagle3Config(draft_vocab_size=3), info)
    drafter.prepare(rows)
    ids = torch.arange(3) + drafter.d2t  # target_id = draft_id + d2t[draft_id]
    assert ids.tolist() == [5, 7, 200] and drafter.draft_ids.tolist() == [5, 7, 200]
    assert drafter.t2d.sum() == 3 and torch.nonzero(drafter.t2d).squeeze(-1).tolist() == ids.tolist()
    torch.testing.assert_close(drafter.lm_head.weight, TargetHead(info).lm_head.weight[ids])
    assert Eagle3Drafter(Eagle3Config(), info).draft_vocab_size == info.vocab_size  # capped at the target's


def test_training_step_learns(tiny_llama_dir):
    """On a learnable stream (each token fixes the next; states are a function of the token) the loss falls
    at every TTT step."""
    torch.manual_seed(0)
    info = TargetInfo.load(tiny_llama_dir)
    head = TargetHead(info)
    head.lm_head.weight.data *= 30  # HF's std-0.02 init gives near-flat logits a trained target never has
    drafter = Eagle3Drafter(Eagle3Config(target_layer_ids=[1, 2, 3], train_lm_head=True), info)
    batch = make_batch(info, drafter.feature_spec().layer_ids)
    make_learnable(batch, info)
    losses, out = train_losses(drafter, batch, head, 40)
    assert losses[-1] < 0.3 * losses[0], losses
    assert out.total_K[:3].min() > 0 and out.total_K[3:].sum() == 0  # 3 TTT steps scored, padded to K=7
    assert out.correct_K.sum() > 0.5 * out.total_K.sum()


def test_propose_teacher_forced_equals_training_chains(tiny_llama_dir):
    """propose() feeds its own drafts; where they equal the true tokens, its states are training's."""
    torch.manual_seed(0)
    info = TargetInfo.load(tiny_llama_dir)
    head = TargetHead(info)
    drafter = Eagle3Drafter(Eagle3Config(target_layer_ids=[1, 2, 3], num_speculative_tokens=3), info).eval()
    batch = make_batch(info, drafter.feature_spec().layer_ids)
    anchors = torch.tensor([25, 10, 12])  # unsorted, two documents
    drafts = drafter.propose(batch, head, anchors)
    pairs = drafter.pairs(batch)
    for n, a in enumerate(anchors.tolist()):
        batch_forced = PackedBatch(**{**batch.__dict__})
        ids = batch.input_ids_T.clone()
        ids[a + 1:a + 3] = drafts[n, :2]  # make the "true" continuation equal the drafts
        batch_forced.input_ids_T = ids
        chain = pairs.index_T[a:a + 1]
        teacher = lambda s, _: ids[a + s:a + s + 1]  # noqa: E731
        normed = drafter.unroll(batch_forced, head, pairs, chain, 3, teacher)
        forced = [int(drafter.draft_ids[drafter.lm_head(x).argmax(-1)]) for x in normed]
        assert forced == drafts[n].tolist()


def _drafter_and_reference(info: TargetInfo, head: TargetHead, tmp_path):
    """A 2-layer drafter with a reduced draft vocabulary (norms away from 1 so a convention mix-up would show),
    exported and loaded back by speculators 0.9.0's own Eagle3DraftModel (fp32, eager attention)."""
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    torch.manual_seed(0)
    drafter = Eagle3Drafter(Eagle3Config(target_layer_ids=[1, 2, 3], num_layers=2, draft_vocab_size=64), info)
    drafter.prepare([TokenizedRow(0, tuple(range(0, 256, 3)), (1,) * 86)])
    for p in drafter.parameters():
        if p.ndim == 1:
            p.data.uniform_(0.5, 1.5)
    drafter.export(tmp_path, info)
    ref = load_reference(Eagle3DraftModel, Eagle3SpeculatorConfig, tmp_path, head)
    assert ref.target_layer_ids == [1, 2, 3] and ref.draft_vocab_size == 64
    assert torch.equal(ref.d2t, drafter.d2t) and torch.equal(ref.t2d, drafter.t2d)
    return drafter, ref


def test_export_matches_speculators_reference(tiny_llama_dir, tmp_path):
    """Our export, loaded by speculators' own Eagle3DraftModel, gives the same logits at every TTT step
    (fp32, 1e-4), with a reduced draft vocabulary and two layers (the second a plain decoder layer)."""
    info = TargetInfo.load(tiny_llama_dir)
    head = TargetHead(info)
    drafter, ref = _drafter_and_reference(info, head, tmp_path)
    ref.eval()
    batch = make_batch(info, drafter.feature_spec().layer_ids)
    pairs = drafter.pairs(batch)
    # speculators' shift_batch per document: input x[1:], hidden g[:-1] = our pairs.
    aux = batch.layers(drafter.target_layer_ids)[pairs.t_S - 1].flatten(1)[None]
    ref_logits = []
    hook = ref.lm_head.register_forward_hook(lambda m, i, o: ref_logits.append(o[0]))
    with torch.no_grad():
        ref(aux, batch.input_ids_T[pairs.t_S][None], pairs.document_ids_S[None], position_ids=pairs.rope_pos_S[None],
            ttt_steps=3)
    hook.remove()
    steps = 3
    # Every chain whose teacher-forced tokens stay inside its document (speculators shifts the whole pack).
    S = pairs.t_S.shape[0]
    ok = torch.tensor([i + steps - 1 < S and pairs.document_ids_S[min(i + steps - 1, S - 1)] == pairs.document_ids_S[i]
                       for i in range(S)])
    chains = torch.nonzero(ok).squeeze(-1)
    anchors = pairs.t_S[chains]
    with torch.no_grad():
        normed = drafter.unroll(batch, head, pairs, chains, steps, lambda s, _: batch.input_ids_T[anchors + s])
    for s in range(steps):
        diff = (drafter.lm_head(normed[s]) - ref_logits[s][chains]).abs().max()
        assert diff <= 1e-4, (s, float(diff))


def test_scored_rows_are_the_ones_vllm_counts(tiny_llama_dir):
    """Step s of the chain at pair t is scored iff token t (the anchor) and token t+1+s are response tokens of
    one document: prompt-anchored chains and predictions past a document are never trained."""
    info = TargetInfo.load(tiny_llama_dir)
    drafter = Eagle3Drafter(Eagle3Config(target_layer_ids=[1, 2, 3]), info)
    batch = make_batch(info, drafter.feature_spec().layer_ids, lengths=(10, 7), prompt=(4, 3))
    pairs = drafter.pairs(batch)
    _, valid_SK = drafter.chain_labels(batch, pairs)
    mask, doc, T = batch.loss_mask_T.tolist(), batch.document_ids_T.tolist(), batch.num_tokens
    for i, t in enumerate(pairs.t_S.tolist()):
        for s in range(drafter.cfg.ttt_steps):
            p = t + 1 + s
            expected = p < T and doc[p] == doc[t] and mask[t] and mask[p]
            assert bool(valid_SK[i, s]) == expected, (t, s)
    assert valid_SK.sum() == (6 - 1) + (6 - 2) + (6 - 3) + (4 - 1) + (4 - 2) + (4 - 3)  # anchors 4..8, 13..15


def test_loss_and_gradients_match_speculators(tiny_llama_dir, tmp_path):
    """training_step's loss and every gradient equal speculators' Eagle3DraftModel forward (eager KL loss) on the
    same weights and batch (fp32, 1e-5 relative). One document of 1 prompt token then response: the scored rows
    coincide when speculators' mask is mask[t] & mask[t+1] (module docstring)."""
    from speculators.losses.eager import kl_div_loss

    info = TargetInfo.load(tiny_llama_dir)
    head = TargetHead(info)
    head.lm_head.weight.data *= 30  # a peaked target, as a trained one is
    drafter, ref = _drafter_and_reference(info, head, tmp_path)
    ref.verifier_lm_head.weight.data.copy_(head.lm_head.weight[drafter.draft_ids])
    batch = make_batch(info, drafter.feature_spec().layer_ids, lengths=(30,), prompt=(1,))
    out = drafter.training_step(batch, head, torch.Generator().manual_seed(0))

    pairs = drafter.pairs(batch)
    t_S, ref_mask = pairs.t_S, speculators_loss_mask(pairs, batch.loss_mask_T)
    ref_out = ref(batch.layers(drafter.target_layer_ids)[t_S - 1].flatten(1)[None], batch.input_ids_T[t_S][None],
                  pairs.document_ids_S[None], loss_mask=ref_mask[None], position_ids=pairs.rope_pos_S[None],
                  verifier_last_hidden_states=batch.layers([info.num_hidden_layers])[t_S, 0][None],
                  ttt_steps=drafter.cfg.ttt_steps, ttt_step_loss_decay=drafter.cfg.ttt_step_loss_decay,
                  loss_config={"kl_div": (kl_div_loss, 1.0)})
    # fc, both layers' projections and norms, the final norm
    assert_same_loss_and_gradients(drafter, out.loss, ref, ref_out[1], min_params=10)


def test_target_side_computed_once_per_position_equals_recomputing_it_per_chain_step(tiny_llama_dir, monkeypatch):
    """DistinctTargets keeps the target's draft-vocab logits per scored position; over TARGET_LOGITS_BUDGET it hands
    chunked_loss the states to recompute them per chain step (the earlier path). Same loss, gradients and metrics;
    and the kept logits are computed for each distinct position once."""
    import specdistill.drafters.targets as targets
    from specdistill.kernels.logits import chunked as chunked_module

    info = TargetInfo.load(tiny_llama_dir)
    head = TargetHead(info)
    head.lm_head.weight.data *= 30
    torch.manual_seed(0)
    drafter = Eagle3Drafter(Eagle3Config(draft_vocab_size=64), info)
    batch = make_batch(info, drafter.feature_spec().layer_ids)
    drafter.prepare([TokenizedRow(0, tuple(batch.input_ids_T.tolist()), tuple(batch.loss_mask_T.int().tolist()))])
    runs, real = {}, chunked_module._chunk_logits
    for budget in (targets.TARGET_LOGITS_BUDGET, 0):
        monkeypatch.setattr(targets, "TARGET_LOGITS_BUDGET", budget)
        recomputed = []  # per chunk of logits: whether the target's were recomputed from its states
        monkeypatch.setattr(chunked_module, "_chunk_logits",
                            lambda *a, seen=recomputed: (seen.append(a[2] is not None), real(*a))[1])
        drafter.zero_grad()
        out = drafter.training_step(batch, head, torch.Generator().manual_seed(0))
        out.loss.backward()
        runs[budget] = (out, {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None},
                        recomputed)
    (kept, kept_grads, kept_recomputed), (again, again_grads, again_recomputed) = runs.values()
    assert not any(kept_recomputed) and all(again_recomputed)  # which path each run took
    assert kept.total_K[:2].min() > 0  # several chain steps scored: positions repeat across them
    torch.testing.assert_close(kept.loss, again.loss, rtol=1e-6, atol=1e-7)
    assert kept_grads.keys() == again_grads.keys() and len(kept_grads) >= 5
    for name in kept_grads:
        torch.testing.assert_close(kept_grads[name], again_grads[name], rtol=1e-5, atol=1e-7, msg=name)
    assert torch.equal(kept.correct_K, again.correct_K) and torch.equal(kept.total_K, again.total_K)

    monkeypatch.undo()  # the default budget again
    pairs = drafter.pairs(batch)
    pos_SK, valid_SK = drafter.chain_labels(batch, pairs)
    prev = pos_SK[valid_SK] - 1
    distinct = targets.DistinctTargets(head, lambda p: drafter.last_layer_at(batch, p), prev, drafter.draft_ids)
    assert distinct.logits_UV.shape == (prev.unique().numel(), 64) and prev.numel() > 2 * prev.unique().numel()


# --- served by vLLM --------------------------------------------------------------------------------------------
# The offline walk (specdistill.evaluation.acceptance) replays vLLM's greedy decode path on the target's true states of vLLM's own
# base outputs, so its counters must equal vLLM's: exactly on fp32 tiny-llama, closely on bf16 tiny-qwen3-next.
# draft_vocab_size below the number of distinct response tokens: the served export really maps through d2t.
TRAIN = ["drafter=eagle3", "drafter.draft_vocab_size=512", "data.rows=48", "data.heldout_rows=8",
         "data.prompt_tokens=120", "data.max_new_tokens=32", "trainer.token_budget=1024", "trainer.max_steps=24",
         "trainer.checkpoint_every=24", "trainer.warmup_steps=4", "trainer.progress=false"]


@pytest.fixture(scope="module", params=["tiny-llama", pytest.param("tiny-qwen3-next", marks=pytest.mark.long)])
def served(request, tmp_path_factory, cache_dir, tiny_target, target_alone_runs):
    from tests.serving_helpers import served_run
    from tests.cli import run_train

    target_dir = tiny_target(request.param)
    run_dir = tmp_path_factory.mktemp(f"eagle3-{request.param}") / "run"
    run_train([f"target={request.param}", *TRAIN, f"hydra.run.dir={run_dir}"], cache_dir)
    config = json.loads((RunDir(run_dir).export / "config.json").read_text())
    assert config["draft_vocab_size"] == 512 and config["speculators_model_type"] == "eagle3"
    return served_run(request.param, run_dir, target_dir, "eagle3", target_alone_runs)


@pytest.mark.slow
@pytest.mark.vllm
def test_served_outputs_are_lossless(served):
    from tests.serving_helpers import assert_lossless

    assert served["spec"].method == "eagle3" and served["spec"].num_speculative_tokens == served["K"] == 7
    assert_lossless(served)


@pytest.mark.slow
@pytest.mark.vllm
def test_served_acceptance_equals_offline_walk(served):
    from tests.serving_helpers import assert_acceptance_matches_offline

    ours = served["offline"]
    assert ours.num_accepted > 0.1 * ours.num_draft_tokens, "drafter too weak for the check to discriminate"
    assert_acceptance_matches_offline(served)


@pytest.mark.slow
@pytest.mark.vllm
def test_off_by_one_layer_ids_are_caught_by_the_acceptance_check(served, tmp_path):
    """vLLM reads eagle_aux_hidden_state_layer_ids in our convention (no offset): shifting them by one still
    serves losslessly, but the counters no longer match the offline walk."""
    if served["name"] != "tiny-llama":
        pytest.skip("run once, on the exact fp32 target")
    from specdistill.evaluation.vllm_serve import serve
    from tests.serving_helpers import MAX_TOKENS

    broken = tmp_path / "export"
    shutil.copytree(RunDir(served["run_dir"]).export, broken)
    config = json.loads((broken / "config.json").read_text())
    config["eagle_aux_hidden_state_layer_ids"] = [i - 1 for i in config["eagle_aux_hidden_state_layer_ids"]]
    (broken / "config.json").write_text(json.dumps(config))
    spec = serve(str(served["target_dir"]), served["prompts"], MAX_TOKENS, str(broken), method="eagle3",
                 ignore_eos=True)
    assert [o[:MAX_TOKENS] for o in served["base"].output_token_ids] == spec.output_token_ids  # still lossless
    assert list(spec.counters.accepted_per_pos) != served["offline"].accepted_per_pos  # but the check fires
