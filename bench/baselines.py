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

from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence

from specdistill.core.contract import TokenizedRow
from specdistill.evaluation.acceptance import AcceptanceCounts, walk


class BigramTable:
    def __init__(self, rows: Iterable[TokenizedRow]):
        counts: dict[int, Counter] = defaultdict(Counter)
        for row in rows:
            ids, mask = row.input_ids, row.loss_mask
            for p in range(1, len(ids)):
                if mask[p]:
                    counts[ids[p - 1]][ids[p]] += 1
        # ties to the lower id: deterministic
        self.next = {prev: min(c, key=lambda t: (-c[t], t)) for prev, c in counts.items()}

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
