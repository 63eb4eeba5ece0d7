"""Model-free drafters, the floor a trained drafter must clear: a bigram table and prompt-lookup n-grams.

Both walk the same greedy decode path as the offline evaluator (specdistill/evaluation/acceptance.py `walk`): from the first
response token, each step proposes up to K tokens from what is known at the anchor (the row up to and including
it), the target accepts the longest matching prefix and adds its own token. A step with no proposal still counts
as a step (1 token), so `tau` here is tokens per step over every step, which is what a user sees (vLLM's own
n-gram counters leave undrafted steps out and overstate it; docs/acceptance.md).

- bigram: the most frequent next response token after each token, counted over the training rows; a draft chains
  it K times. Its a_1 is the table's next-token accuracy.
- ngram: vLLM's prompt lookup: the longest suffix of n = max_n..min_n tokens that occurred earlier in the row;
  propose the K tokens that followed its most recent earlier occurrence.
"""

from collections.abc import Iterable, Sequence

import numpy as np

from specdistill.core.contract import TokenizedRow
from specdistill.evaluation.acceptance import AcceptanceCounts, walk


class BigramTable:
    def __init__(self, rows: Iterable[TokenizedRow]):
        pairs = []  # (previous token, response token) at every response position but a row's first token
        for row in rows:
            ids, mask = np.asarray(row.input_ids, dtype=np.int64), np.asarray(row.loss_mask, dtype=bool)
            at = np.flatnonzero(mask[1:]) + 1
            pairs.append(np.stack([ids[at - 1], ids[at]], axis=1))
        pairs_P2 = np.concatenate(pairs) if pairs else np.zeros((0, 2), dtype=np.int64)
        unique, counts = np.unique(pairs_P2, axis=0, return_counts=True)  # sorted by (previous, next)
        # per previous token, the most frequent next one; ties to the lower id (deterministic): sort by
        # (previous, -count, next) and keep each previous token's first
        order = np.lexsort((unique[:, 1], -counts, unique[:, 0]))
        best = unique[order]
        first = np.concatenate([[True], best[1:, 0] != best[:-1, 0]]) if len(best) else np.zeros(0, dtype=bool)
        self.next = dict(zip(best[first, 0].tolist(), best[first, 1].tolist()))

    def propose(self, context: Sequence[int], K: int) -> list[int]:
        out, last = [], context[-1]
        for _ in range(K):
            if last not in self.next:
                break
            last = self.next[last]
            out.append(last)
        return out


class PromptLookup:
    def __init__(self, min_n: int = 1, max_n: int = 4):
        self.min_n, self.max_n = min_n, max_n

    def propose(self, context: Sequence[int], K: int) -> list[int]:
        T = len(context)
        for n in range(min(self.max_n, T - 1), self.min_n - 1, -1):
            suffix = list(context[T - n:])
            for start in range(T - n - 1, -1, -1):  # most recent earlier occurrence first
                if list(context[start:start + n]) == suffix:
                    return list(context[start + n:start + n + K])
        return []


def response_span(mask: Sequence[int]) -> tuple[int, int]:
    idx = [i for i, m in enumerate(mask) if m]
    return idx[0], idx[-1] + 1


def acceptance(drafter, rows: Iterable[tuple[Sequence[int], Sequence[int]]], K: int) -> AcceptanceCounts:
    """Offline greedy acceptance of a model-free drafter over (tokens, loss_mask) rows; tokens are the target's."""
    counts = AcceptanceCounts(K=K)
    for tokens, mask in rows:
        if sum(mask) < 2:
            continue
        start, stop = response_span(mask)
        drafts = {a: drafter.propose(tokens[:a + 1], K) for a in range(start, stop - 1)}
        walk(drafts, list(tokens), start, stop, counts)
    return counts


# Training rows a run's bigram table is counted over (metrics.json baselines): the first rows of the file, enough for
# the table's common pairs; counting 847k rows of 5k tokens in Python would take longer than the run's walks.
BIGRAM_ROWS = 20_000


def baseline_reports(train_rows, walked: list[tuple[Sequence[int], Sequence[int]]], Ks: list[int]) -> dict:
    """metrics.json `baselines` at each of `Ks` (drafters of one run may draft different numbers of tokens: each is
    compared with baselines that draft as many): the bigram table (counted once, over the first BIGRAM_ROWS training
    rows) and prompt-lookup n-grams (1-4), walked over `walked` (tokens, loss_mask) rows as the drafters' held-out
    report walks them."""
    bigram = BigramTable(train_rows[:BIGRAM_ROWS])
    return {K: {"bigram": acceptance(bigram, walked, K).to_dict(),
                "ngram": acceptance(PromptLookup(min_n=1, max_n=4), walked, K).to_dict()} for K in sorted(set(Ks))}
