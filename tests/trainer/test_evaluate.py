"""The offline decode-path walk: the same counters a greedy speculative engine reports."""

from trainer.evaluate import AcceptanceCounts, walk


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
