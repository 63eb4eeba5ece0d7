"""The offline decode-path walk: the same counters a greedy speculative engine reports."""

from specdistill.evaluation.acceptance import AcceptanceCounts, walk


def test_walk_follows_anchor_plus_accepted_plus_one():
    tokens = list(range(100, 120))
    start, stop = 5, 15  # tokens[5] is the target's prefill output
    truth = {a: tokens[a + 1: a + 4] for a in range(start, stop)}
    drafts = {a: list(truth[a]) for a in truth}
    drafts[5] = [tokens[6], tokens[7], -1]  # 2 accepted -> next anchor 8
    drafts[8] = [-1, -1, -1]  # 0 accepted -> next anchor 9
    # anchor 9: all 3 accepted -> 13; anchor 13: only position 14 exists before stop -> 1 accepted
    counts = AcceptanceCounts(K=3)
    walk(drafts, tokens, start, stop, counts)
    assert counts.num_drafts == 4
    assert counts.num_accepted == 2 + 0 + 3 + 1
    assert counts.accepted_per_pos == [3, 2, 1]
    assert counts.num_draft_tokens == 12
    assert counts.tau == 1 + 6 / 4
    assert counts.per_position == [0.75, 0.5, 0.25]
    assert counts.conditional == [0.75, 2 / 3, 0.5]


def test_walk_on_a_one_token_response_makes_no_draft():
    counts = AcceptanceCounts(K=2)
    walk({}, [1, 2, 3], 2, 3, counts)
    assert counts.num_drafts == 0 and counts.tau == 1.0


def test_walk_compares_past_stop_when_the_tokens_are_known():
    tokens = list(range(10))
    drafts = {2: [3, 4, 5]}
    short, long = AcceptanceCounts(K=3), AcceptanceCounts(K=3)
    walk(drafts, tokens, 2, 4, short)  # max_tokens reached after 2 generated: one verification step
    walk(drafts, tokens, 2, 4, long, known_until=10)
    assert short.accepted_per_pos == [1, 0, 0] and long.accepted_per_pos == [1, 1, 1]


# --- T > 0: the lossless rule --------------------------------------------------------------------------------
import json  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from specdistill.core.batch import PackedBatch  # noqa: E402
from specdistill.core.contract import FeatureSample  # noqa: E402
from specdistill.evaluation.acceptance import (  # noqa: E402
    NO_STAGE, evaluate, evaluate_report, sampled_walk, verify_lossless)


def test_verify_lossless_emits_the_target_distribution_and_accepts_sum_min_p_q():
    """Speculative sampling is lossless: whatever q drafts, the first emitted token is distributed as p, and
    slot 1 is accepted with probability sum_x min(p(x), q(x)) = 1 - TV(p, q)."""
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.25] * 4])
    q = torch.tensor([[0.1, 0.1, 0.4, 0.4]])
    g = torch.Generator().manual_seed(0)
    trials, emitted, accepted = 20000, torch.zeros(4), 0
    for _ in range(trials):
        x = torch.multinomial(q[0], 1, generator=g)
        n, token = verify_lossless(p, q, x, g)
        accepted += n
        emitted[int(x) if n == 1 else token] += 1
    # 20000 draws: the binomial std of a frequency is <= 0.0036, so 0.015 is > 4 sigma.
    torch.testing.assert_close(emitted / trials, p[0], atol=0.015, rtol=0)
    assert abs(accepted / trials - float(torch.minimum(p[0], q[0]).sum())) < 0.015


def test_verify_lossless_with_a_one_hot_draft_accepts_while_the_draft_is_ps_sample():
    p = torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    one_hot = torch.nn.functional.one_hot(torch.tensor([1, 2]), 3).float()
    g = torch.Generator().manual_seed(0)
    assert verify_lossless(p, one_hot, torch.tensor([1, 2]), g) == (1, 0)  # slot 2 rejected: residual = p
    assert verify_lossless(p, one_hot[:1], torch.tensor([1]), g) == (1, 0)  # all accepted: bonus from p[1]


def _logits_favouring(tokens, V, margin):
    logits = torch.zeros(len(tokens), V)
    logits[torch.arange(len(tokens)), torch.tensor(tokens)] = margin
    return logits


def test_sampled_walk_at_tiny_temperature_is_the_greedy_walk():
    """T -> 0 makes p one-hot at the target's argmax (the row's token): both modes reduce to the greedy walk."""
    V, K, start, stop = 12, 3, 4, 16
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, V, (stop,), generator=g).tolist()
    anchors = list(range(start, stop - 1))
    right_NK = torch.rand(len(anchors), K, generator=g) > 0.3
    drafts_NK = torch.tensor([[tokens[min(a + 1 + i, stop - 1)] if right_NK[n, i] else (tokens[a] + 1) % V
                               for i in range(K)] for n, a in enumerate(anchors)])
    target_TV = _logits_favouring(tokens[1:] + [0], V, 5.0)  # row t predicts token t+1
    greedy = AcceptanceCounts(K=K)
    walk(dict(zip(anchors, drafts_NK.tolist())), tokens, start, stop, greedy)
    for q in (None, torch.nn.functional.one_hot(drafts_NK, V).float()):  # greedy mode; "sample" with q one-hot
        sampled = AcceptanceCounts(K=K)
        sampled_walk(drafts_NK, q, lambda i0, i1: target_TV[i0:i1], start, stop, stop, 1e-3, sampled,
                     torch.Generator().manual_seed(0))
        assert sampled == greedy
    assert greedy.num_accepted > 0 and greedy.accepted_per_pos[0] < greedy.num_drafts  # not a trivial case


def test_sampled_walk_acceptance_falls_as_the_target_flattens():
    V, K, start, stop = 16, 4, 2, 200
    tokens = [(7 * t) % V for t in range(stop)]
    drafts = torch.tensor([[tokens[min(a + 1 + i, stop - 1)] for i in range(K)] for a in range(start, stop - 1)])
    target_TV = _logits_favouring(tokens[1:] + [0], V, 3.0)
    taus = []
    for T in (0.01, 1.0, 3.0):
        counts = AcceptanceCounts(K=K)
        sampled_walk(drafts, None, lambda i0, i1: target_TV[i0:i1], start, stop, stop, T, counts,
                     torch.Generator().manual_seed(0))
        taus.append(counts.tau)
    # Drafts are the row, so at T -> 0 all are accepted (clipped by the end of the row); p(x) falls with T.
    assert taus[0] > taus[1] > taus[2] > 1.0


# --- drafters' draft distribution and the per-stage report ---------------------------------------------------
def _drafters(tiny_llama_dir):
    from specdistill.drafters.dflash import DFlashConfig, DFlashDrafter
    from specdistill.drafters.dflash2 import DFlash2Config, DFlash2Drafter
    from specdistill.drafters.dspark import DSparkConfig, DSparkDrafter
    from specdistill.drafters.eagle3 import Eagle3Config, Eagle3Drafter
    from specdistill.core.target import TargetInfo

    info = TargetInfo.load(tiny_llama_dir)
    small = dict(num_layers=1, target_layer_ids=[1, 2, 3], sliding_window=None, block_size=4)
    eagle3 = Eagle3Drafter(Eagle3Config(target_layer_ids=[1, 2, 3], num_speculative_tokens=3, draft_vocab_size=64),
                           info)
    eagle3.prepare([])  # a 64-token draft vocabulary (padded with the lowest ids)
    return info, {"dflash": DFlashDrafter(DFlashConfig(**small), info, 3),
                  "dspark": DSparkDrafter(DSparkConfig(**small, markov_rank=8, sample_from_anchor=False), info, 3),
                  "dflash2": DFlash2Drafter(DFlash2Config(**small), info, 3), "eagle3": eagle3}


def _batch(info, layer_ids, lengths=(24, 20), prompt=(8, 6), seed=0):
    g = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    return PackedBatch(torch.randint(0, info.vocab_size, (T,), generator=g),
                       torch.cat([torch.arange(n) >= p for n, p in zip(lengths, prompt)]),
                       torch.randn(T, len(layer_ids), info.hidden_size, generator=g),
                       torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)),
                       torch.cat([torch.arange(n) for n in lengths]), tuple(layer_ids), tuple(range(len(lengths))))


@pytest.mark.parametrize("name", ["dflash", "dspark", "dflash2", "eagle3"])
def test_draft_distribution_argmax_is_the_greedy_draft_when_the_row_follows_it(tiny_llama_dir, name):
    """q is teacher-forced on the row; where the row continues with the drafts, argmax q == propose()."""
    torch.manual_seed(0)
    info, drafters = _drafters(tiny_llama_dir)
    drafter = drafters[name].eval()
    from specdistill.core.target import TargetHead

    head = TargetHead(info)
    batch = _batch(info, drafter.feature_spec().layer_ids)
    anchors = torch.tensor([10, 30])  # one per document
    drafts = drafter.propose(batch, head, anchors)
    for n, a in enumerate(anchors.tolist()):
        batch.input_ids_T[a + 1:a + 1 + drafts.shape[1]] = drafts[n]
    with torch.no_grad():
        logits = drafter.draft_logits(batch, head, anchors)
    assert logits.shape == (2, drafter.num_speculative_tokens, info.vocab_size)
    assert torch.equal(logits.argmax(-1), drafter.propose(batch, head, anchors))


@pytest.mark.parametrize("name", ["dflash", "dspark", "dflash2", "eagle3", "mtp"])
def test_sampled_drafting_walks_every_anchor_to_the_row_end(tiny_llama_dir, tmp_path, name):
    """draft_mode=sample asks each drafter for its distribution at every anchor of the response, the last ones
    included (anchor + K runs past the row): no drafter may index past the row, and every anchor is walked."""
    from specdistill.core.target import TargetHead, TargetInfo
    from specdistill.evaluation.acceptance import AcceptanceCounts, evaluate_sample

    if name == "mtp":
        from specdistill.drafters.mtp import MTPConfig, MTPDrafter
        from specdistill.launch.targets import make_target

        info = TargetInfo.load(make_target("tiny-qwen3-next", tmp_path / "t", fit_steps=0))
        drafter = MTPDrafter(MTPConfig(num_speculative_tokens=3), info)
    else:
        info, drafters = _drafters(tiny_llama_dir)
        drafter = drafters[name]
    head, counts = TargetHead(info), AcceptanceCounts(drafter.num_speculative_tokens)
    batch = _batch(info, drafter.feature_spec().layer_ids, lengths=(24,), prompt=(8,))
    with torch.no_grad():
        evaluate_sample(drafter.eval(), head, batch, counts, temperature=1.0, draft_mode="sample", seed=1)
    assert counts.num_drafts >= (24 - 8 - 1) // (drafter.num_speculative_tokens + 1)  # the walk reached the end
    assert counts.rows_too_short == 0


def test_draft_distribution_of_mtp(tmp_path):
    from specdistill.drafters.mtp import MTPConfig, MTPDrafter
    from specdistill.launch.targets import make_target
    from specdistill.core.target import TargetHead, TargetInfo

    info = TargetInfo.load(make_target("tiny-qwen3-next", tmp_path / "t", fit_steps=0))
    head = TargetHead(info)
    drafter = MTPDrafter(MTPConfig(num_speculative_tokens=3), info).eval()
    batch = _batch(info, drafter.feature_spec().layer_ids)
    anchors = torch.tensor([10, 30])
    drafts = drafter.propose(batch, head, anchors)
    for n, a in enumerate(anchors.tolist()):
        batch.input_ids_T[a + 1:a + 4] = drafts[n]
    with torch.no_grad():
        assert torch.equal(drafter.draft_logits(batch, head, anchors).argmax(-1), drafter.propose(batch, head, anchors))


def _make_rows_the_targets_greedy(sample, head, last):
    """Drafts are judged against the target's argmax: point its last-layer state at p-1 to the row's token at p
    (the drafter does not read layer L, so its drafts stay the same)."""
    rows_V = head.lm_head.weight
    sample.hidden_TLD[:-1, last] = rows_V[sample.input_ids_T[1:]] * 10
    assert torch.equal(head.argmax(sample.hidden_TLD[:-1, last]), sample.input_ids_T[1:])


def test_report_by_stage_sums_to_the_total_and_is_seeded_per_row(tiny_llama_dir):
    from specdistill.core.target import TargetHead

    torch.manual_seed(0)
    info, drafters = _drafters(tiny_llama_dir)
    drafter, head = drafters["dflash"], TargetHead(info)
    layer_ids = drafter.feature_spec().layer_ids
    g = torch.Generator().manual_seed(0)
    samples = [FeatureSample(i, torch.randint(0, info.vocab_size, (30,), generator=g),
                             torch.arange(30) >= 10, torch.randn(30, len(layer_ids), info.hidden_size, generator=g))
               for i in range(4)]
    # Make the drafter right sometimes: rows continue with its own greedy drafts from every 3rd anchor.
    for s in samples:
        batch = _batch(info, layer_ids)
        batch.input_ids_T, batch.hidden_TLD = s.input_ids_T, s.hidden_TLD
        batch.loss_mask_T, batch.document_ids_T = s.loss_mask_T, torch.zeros(30, dtype=torch.long)
        batch.position_ids_T = torch.arange(30)
        for a in range(10, 27, 4):
            s.input_ids_T[a + 1:a + 4] = drafter.propose(batch, head, torch.tensor([a]))[0]
        _make_rows_the_targets_greedy(s, head, layer_ids.index(info.num_hidden_layers))
    stages = {0: "x", 1: "y", 2: "x"}
    args = (drafter, head, samples, layer_ids, torch.device("cpu"), torch.float32)
    greedy = evaluate_report(*args, stages=stages)
    assert set(greedy.by_stage) == {"x", "y", NO_STAGE}
    assert greedy.total == evaluate(*args) and greedy.total.num_accepted > 0
    # Each stage's counts are what walking that stage's rows alone gives (rows 0 and 2 are "x", row 3 has none).
    for stage, ids in (("x", [0, 2]), ("y", [1]), (NO_STAGE, [3])):
        alone = evaluate(drafter, head, [samples[i] for i in ids], *args[3:])
        assert greedy.by_stage[stage] == alone, stage
    for mode in ("greedy", "sample"):
        one = evaluate_report(*args, stages=stages, temperature=1.0, draft_mode=mode, seed=3)
        again = evaluate_report(drafter, head, samples[::-1], *args[3:], stages=stages, temperature=1.0,
                                draft_mode=mode, seed=3)
        assert one.to_dict() == again.to_dict()  # order-independent under a seed
        assert json.loads(json.dumps(one.to_dict()))["by_stage"]["x"]["K"] == 3
    with pytest.raises(ValueError, match="draft_mode"):
        evaluate_report(*args, draft_mode="beam")


class _TargetGreedyDrafter(torch.nn.Module):
    """Drafts exactly the target's greedy continuation (argmax of the head on the layer-L state before each
    position), whatever the row says: accepted in full by an engine that verifies against the target."""

    num_speculative_tokens = 3

    def __init__(self, last: int):
        super().__init__()
        self.last = last

    def propose(self, batch, head, anchors_N):
        greedy_T = head.argmax(batch.hidden_TLD[:, self.last])  # greedy_T[p] = the target's token at p + 1
        at_NK = anchors_N[:, None] + torch.arange(self.num_speculative_tokens)
        return greedy_T[at_NK.clamp(max=len(greedy_T) - 1)]


def test_drafts_are_judged_against_the_targets_greedy_tokens_not_the_rows(tiny_llama_dir):
    """Rows not written by this target greedily: half the response positions hold another token than the target's
    argmax. A drafter of the target's greedy continuation is then fully accepted (what vLLM does: it verifies
    against the target), and the disagreement is measured; judging against the row would accept ~half."""
    from specdistill.core.target import TargetHead, TargetInfo

    info = TargetInfo.load(tiny_llama_dir)
    head, layer_ids = TargetHead(info), (info.num_hidden_layers,)
    g = torch.Generator().manual_seed(0)
    samples = []
    for i in range(3):
        T, prompt = 40, 10
        hidden = torch.randn(T, 1, info.hidden_size, generator=g)
        greedy_next = head.argmax(hidden[:, 0])  # the target's token at p, from the state at p - 1
        ids = torch.randint(0, info.vocab_size, (T,), generator=g)
        ids[prompt::2] = greedy_next[prompt - 1:-1:2]  # agree at even positions ...
        ids[prompt + 1::2] = (greedy_next[prompt:-1:2] + 1) % info.vocab_size  # ... and differ at odd ones
        samples.append(FeatureSample(i, ids, torch.arange(T) >= prompt, hidden))
    counts = evaluate(_TargetGreedyDrafter(0), head, samples, layer_ids, torch.device("cpu"), torch.float32)
    assert counts.disagreement_fraction == pytest.approx(0.5)  # 15 of the 30 response positions of each row
    # 30 response tokens per row: 7 drafts accepted in full (4 tokens each with the target's own), then one with
    # a single known position left (the row ends): a_k = [8, 7, 7] / 8 drafts, exactly.
    assert counts.num_drafts == 8 * len(samples)
    assert counts.per_position == pytest.approx([1.0, 7 / 8, 7 / 8])
