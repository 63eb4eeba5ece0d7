"""Model-free drafters (specdistill/evaluation/baselines.py): the floor a trained drafter is compared against."""

from specdistill.evaluation.baselines import BigramTable, PromptLookup, acceptance
from specdistill.core.contract import TokenizedRow


def test_bigram_table_chains_the_most_frequent_next_response_token():
    rows = [TokenizedRow(0, (1, 2, 3, 2, 3, 2, 4), (0, 1, 1, 1, 1, 1, 1)),
            TokenizedRow(1, (9, 2, 3), (0, 0, 0))]  # prompt-only: never counted
    table = BigramTable(rows)
    assert table.next == {1: 2, 2: 3, 3: 2}  # 2 -> 3 twice, 2 -> 4 once
    assert table.propose([7, 2], 4) == [3, 2, 3, 2]
    assert table.propose([9], 3) == []  # never seen before a response token


def test_prompt_lookup_copies_what_followed_the_latest_earlier_match():
    lookup = PromptLookup(min_n=1, max_n=3)
    assert lookup.propose([5, 6, 7, 8, 5, 6, 9, 5, 6], 2) == [9, 5]  # the latest "5 6" was followed by 9
    assert lookup.propose([5, 6, 7, 8, 1, 2, 6, 7], 3) == [8, 1, 2]  # longest suffix first: "6 7"
    assert lookup.propose([1, 2, 3], 2) == []


def test_acceptance_counts_undrafted_steps_as_one_token():
    tokens = [1, 2, 1, 2, 1, 2, 1, 2]
    mask = [0, 0, 1, 1, 1, 1, 1, 1]
    perfect = acceptance(PromptLookup(), [(tokens, mask)], K=3)
    # anchors 2.. : each step drafts "2 1 2"-style continuations that all match -> 3 accepted + 1
    assert perfect.tau > 2.0 and perfect.per_position[0] == 1.0
    never = acceptance(BigramTable([]), [(tokens, mask)], K=3)
    assert never.tau == 1.0 and never.num_drafts == 5  # 6 response tokens: the first from prefill, then 5 steps
