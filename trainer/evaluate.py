"""Offline acceptance: walk the decode path a serving engine takes, on the target's true states.

Greedy speculative decoding from the end of the prompt: the target emits the first response token
(prefill); each step the drafter proposes K tokens from the last verified token (the anchor), the target
accepts the longest matching prefix n and adds its own token, so the next anchor is anchor + n + 1.
Since a block's draft depends only on states before its anchor and the anchor token, the drafts of
all anchors come from one batched pass, and the walk just reads them.

tau = 1 + mean accepted per step; a_k = fraction of steps whose first k drafts were all accepted.
"""

from dataclasses import dataclass, field

import torch

from trainer.batch import PackedBatch, pack


@dataclass
class AcceptanceCounts:
    """The same counters vLLM reports: drafts, draft tokens, accepted tokens, accepted per position."""

    K: int
    num_drafts: int = 0
    num_accepted: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self):
        self.accepted_per_pos = self.accepted_per_pos or [0] * self.K

    def add_step(self, accepted: int) -> None:
        self.num_drafts += 1
        self.num_accepted += accepted
        for k in range(accepted):
            self.accepted_per_pos[k] += 1

    @property
    def num_draft_tokens(self) -> int:
        return self.num_drafts * self.K

    @property
    def tau(self) -> float:
        return 1.0 + self.num_accepted / max(1, self.num_drafts)

    @property
    def per_position(self) -> list[float]:
        """Cumulative acceptance a_k, k = 1..K."""
        return [n / max(1, self.num_drafts) for n in self.accepted_per_pos]

    @property
    def conditional(self) -> list[float]:
        """a_k / a_{k-1}: it rises with depth on JSON."""
        prev = [self.num_drafts] + self.accepted_per_pos[:-1]
        return [n / p if p else 0.0 for n, p in zip(self.accepted_per_pos, prev)]


def walk(drafts_by_anchor: dict[int, list[int]], tokens: list[int], start: int, stop: int, counts: AcceptanceCounts,
         known_until: int | None = None) -> None:
    """Greedy decode path over response positions [start, stop); tokens[start] came from prefill.

    An engine verifies the whole draft even past its max_tokens (then truncates the output), so drafts
    are compared up to `known_until` (default `stop`) when the target's tokens beyond `stop` are known.
    """
    known_until = stop if known_until is None else known_until
    generated = 1
    while start + generated < stop:
        anchor = start + generated - 1
        accepted = 0
        for i, token in enumerate(drafts_by_anchor[anchor]):
            pos = anchor + 1 + i
            if pos >= known_until or token != tokens[pos]:
                break
            accepted += 1
        counts.add_step(accepted)
        generated += accepted + 1


def response_span(loss_mask_T: torch.Tensor) -> tuple[int, int]:
    """[start, stop) of the response: the first and one past the last loss-carrying token."""
    idx = torch.nonzero(loss_mask_T).squeeze(-1)
    return int(idx[0]), int(idx[-1]) + 1


@torch.no_grad()
def evaluate_sample(drafter, head, sample_batch: PackedBatch, counts: AcceptanceCounts, max_generated: int | None = None) -> None:
    """Walk one row's response; with max_generated, stop after that many tokens (an engine's max_tokens)
    and use the rest of the row as the target's tokens beyond it."""
    start, end = response_span(sample_batch.loss_mask_T)
    stop = end if max_generated is None else min(end, start + max_generated)
    if stop - start < 2:
        return
    anchors_N = torch.arange(start, stop - 1, device=sample_batch.input_ids_T.device)
    drafts_NK = drafter.propose(sample_batch, head, anchors_N).tolist()
    drafts = dict(zip(anchors_N.tolist(), drafts_NK))
    walk(drafts, sample_batch.input_ids_T.tolist(), start, stop, counts, known_until=end)


@torch.no_grad()
def evaluate(drafter, head, samples, layer_ids, device, dtype, max_generated: int | None = None) -> AcceptanceCounts:
    """Offline acceptance over held-out FeatureSamples (one row per pass)."""
    counts = AcceptanceCounts(K=drafter.num_speculative_tokens)
    was_training = drafter.training
    drafter.eval()
    for sample in samples:
        evaluate_sample(drafter, head, pack([sample], layer_ids).to(device, dtype), counts, max_generated)
    drafter.train(was_training)
    return counts
