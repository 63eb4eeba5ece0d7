"""Offline acceptance: walk the decode path a serving engine takes, on the target's true states.

Greedy speculative decoding from the end of the prompt: the target emits the first response token
(prefill); each step the drafter proposes K tokens from the last verified token (the anchor), the target
accepts the longest matching prefix n and adds its own token, so the next anchor is anchor + n + 1.
Since a block's draft depends only on states before its anchor and the anchor token, the drafts of
all anchors come from one batched pass, and the walk just reads them.

T > 0 (`temperature`): the lossless rule (Leviathan et al. 2023; docs/acceptance.md):
draft x_k is accepted with probability min(1, p_k(x_k) / q_k(x_k)), p = softmax(target logits / T),
q = the draft distribution; the first rejection resamples from normalize(max(0, p - q)). Two drafting
modes: "greedy" (q one-hot at propose()'s draft, as vLLM drafts: accept while the draft equals a sample
from p) and "sample" (q = softmax(draft logits / T), x ~ q, the logits from each drafter's own
`draft_logits`). The walk stays on the row: contexts after an accepted token are the row's own tokens
(teacher forcing), which is exact whenever the accepted token is the row's (always at T -> 0) and an
approximation otherwise. Randomness is seeded per (seed, row_id), so counts do not depend on the order
rows stream in.

tau = 1 + mean accepted per step; a_k = fraction of steps whose first k drafts were all accepted.
Results can be broken down by workload stage (the dataset rows' "stage": the token store's `stages_by_row_id`, or
`load_rows(..., stages=...)` for a small file).
"""

from dataclasses import dataclass, field, replace

import torch

from specdistill.core.batch import PackedBatch, pack

DRAFT_MODES = ("greedy", "sample")
NO_STAGE = "unstaged"  # rows without a "stage" field (chat / prompt-response datasets)


@dataclass
class AcceptanceCounts:
    """The same counters vLLM reports: drafts, draft tokens, accepted tokens, accepted per position."""

    K: int
    num_drafts: int = 0
    num_accepted: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    # Response positions walked, and those where the row's token is not the target's greedy one (greedy walks).
    response_positions: int = 0
    disagreements: int = 0
    rows_too_short: int = 0  # responses of < 2 tokens: no draft step fits

    def __post_init__(self):
        self.accepted_per_pos = self.accepted_per_pos or [0] * self.K

    def add_step(self, accepted: int) -> None:
        self.num_drafts += 1
        self.num_accepted += accepted
        for k in range(accepted):
            self.accepted_per_pos[k] += 1

    def merge(self, other: "AcceptanceCounts") -> None:
        self.num_drafts += other.num_drafts
        self.num_accepted += other.num_accepted
        self.accepted_per_pos = [a + b for a, b in zip(self.accepted_per_pos, other.accepted_per_pos, strict=True)]
        self.response_positions += other.response_positions
        self.disagreements += other.disagreements
        self.rows_too_short += other.rows_too_short

    @property
    def disagreement_fraction(self) -> float:
        """Fraction of walked response positions where the row is not the target's greedy continuation."""
        return self.disagreements / max(1, self.response_positions)

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

    def to_dict(self) -> dict:
        return {"tau": self.tau, "per_position": self.per_position, "conditional": self.conditional,
                "num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted": self.num_accepted, "accepted_per_pos": list(self.accepted_per_pos), "K": self.K,
                "target_disagreement": self.disagreement_fraction, "rows_too_short": self.rows_too_short}


@dataclass
class AcceptanceReport:
    """Totals plus the same counters per workload stage."""

    total: AcceptanceCounts
    by_stage: dict[str, AcceptanceCounts]
    temperature: float = 0.0
    draft_mode: str = "greedy"

    def to_dict(self) -> dict:
        return {"temperature": self.temperature, "draft_mode": self.draft_mode, **self.total.to_dict(),
                "by_stage": {s: c.to_dict() for s, c in sorted(self.by_stage.items())}}


# --- the walks --------------------------------------------------------------------------------------------
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


def verify_lossless(p_KV: torch.Tensor, q_KV: torch.Tensor, draft_K: torch.Tensor,
                    generator: torch.Generator) -> tuple[int, int | None]:
    """Speculative sampling's verification of one draft: (accepted count n, the token the target emits next).

    p_KV: target probabilities for the draft slots (+ optionally one more row for the bonus token when all
    are accepted); q_KV: draft probabilities of the K slots. The emitted token is distributed exactly as p.
    """
    K = draft_K.shape[0]
    for k in range(K):
        x = int(draft_K[k])
        p, q = float(p_KV[k, x]), float(q_KV[k, x])
        if q > 0 and torch.rand((), generator=generator).item() < min(1.0, p / q):
            continue
        residual_V = (p_KV[k] - q_KV[k]).clamp(min=0)
        if residual_V.sum() <= 0:  # p == q: rejection has probability 0; guard the rounding case
            residual_V = p_KV[k]
        return k, int(torch.multinomial(residual_V, 1, generator=generator))
    bonus = int(torch.multinomial(p_KV[K], 1, generator=generator)) if p_KV.shape[0] > K else None
    return K, bonus


def sampled_walk(draft_NK: torch.Tensor, q_NKV: torch.Tensor | None, target_logits_TV, start: int, stop: int,
                 known_until: int, temperature: float, counts: AcceptanceCounts,
                 generator: torch.Generator) -> None:
    """The T > 0 decode path over [start, stop): anchors are start..stop-2 (row n of draft_NK / q_NKV).

    q_NKV None = greedy drafting (one-hot q at draft_NK). target_logits_TV(i0, i1): target logits predicting
    positions i0+1..i1 (from the states at i0..i1-1).
    """
    generated = 1
    while start + generated < stop:
        anchor = start + generated - 1
        n, k_known = anchor - start, min(draft_NK.shape[1], known_until - anchor - 1)
        p_KV = torch.softmax(target_logits_TV(anchor, anchor + k_known).float() / temperature, -1)
        if q_NKV is None:
            draft_K = draft_NK[n, :k_known]
            q_KV = torch.nn.functional.one_hot(draft_K, p_KV.shape[-1]).float()
        else:
            q_KV = q_NKV[n, :k_known]
            draft_K = torch.multinomial(q_KV, 1, generator=generator)[:, 0] if k_known else draft_NK[n, :0]
        accepted, _ = verify_lossless(p_KV, q_KV, draft_K, generator)
        counts.add_step(accepted)
        generated += accepted + 1


def response_span(loss_mask_T: torch.Tensor) -> tuple[int, int]:
    """[start, stop) of the response: the first and one past the last loss-carrying token."""
    idx = torch.nonzero(loss_mask_T).squeeze(-1)
    return int(idx[0]), int(idx[-1]) + 1


# --- evaluation -------------------------------------------------------------------------------------------
def target_tokens(sample_batch: PackedBatch, head, num_hidden_layers: int, start: int, end: int) -> list[int]:
    """The row's tokens with response positions [start, end) replaced by the target's own greedy choice there
    (argmax of its distribution from the layer-L state one position earlier): what the target emits, and so what
    a serving engine verifies drafts against."""
    tokens = sample_batch.input_ids_T.tolist()
    start = max(start, 1)  # a row with no prompt: nothing predicts its first token
    states = torch.arange(start - 1, end - 1, device=sample_batch.input_ids_T.device)
    tokens[start:end] = head.argmax(sample_batch.layer_at(num_hidden_layers, states)).tolist()
    return tokens


@torch.no_grad()
def target_row(sample, spec, head, device: torch.device | str = "cpu") -> list[int]:
    """A sample's whole row of tokens (from its first: what prompt lookup searches) with its response replaced by
    the target's own greedy tokens (`target_tokens`, from the states the sample shipped): what the baselines walk."""
    batch = pack([sample], spec).to(torch.device(device), torch.float32)
    idx = torch.nonzero(sample.loss_mask_T).flatten()
    cut = sample.num_tokens - batch.num_real_tokens  # the pack holds the row from its context_start
    shipped = target_tokens(batch, head, head.info.num_hidden_layers, int(idx[0]) - cut, int(idx[-1]) + 1 - cut)
    return sample.input_ids_T[:cut].tolist() + shipped


@torch.no_grad()
def evaluate_sample(drafter, head, sample_batch: PackedBatch, counts: AcceptanceCounts, max_generated: int | None = None,
                    temperature: float = 0.0, draft_mode: str = "greedy", seed: int = 0) -> None:
    """Walk one row's response; with max_generated, stop after that many tokens (an engine's max_tokens)
    and use the rest of the row as the target's tokens beyond it.

    Greedy (T = 0) drafts are judged against the target's own greedy tokens (`target_tokens`), not the row's: the
    two differ where the row was not written by this target greedily, and `counts.disagreements` says how often."""
    start, end = response_span(sample_batch.loss_mask_T)
    stop = end if max_generated is None else min(end, start + max_generated)
    if stop - start < 2:
        counts.rows_too_short += 1
        return
    anchors_N = torch.arange(start, stop - 1, device=sample_batch.input_ids_T.device)
    drafts_NK = drafter.propose(sample_batch, head, anchors_N)
    if temperature <= 0:
        greedy = target_tokens(sample_batch, head, head.info.num_hidden_layers, start, end)
        row = sample_batch.input_ids_T.tolist()
        counts.response_positions += end - start
        counts.disagreements += sum(greedy[p] != row[p] for p in range(start, end))
        walk(dict(zip(anchors_N.tolist(), drafts_NK.tolist())), greedy, start, stop, counts, known_until=end)
        return
    q_NKV = None
    if draft_mode == "sample":
        q_NKV = torch.softmax(drafter.draft_logits(sample_batch, head, anchors_N).float() / temperature, -1)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + sample_batch.row_ids[0])
    last = lambda i0, i1: sample_batch.layer_at(head.info.num_hidden_layers,  # noqa: E731
                                                torch.arange(i0, i1, device=anchors_N.device))
    sampled_walk(drafts_NK.cpu(), None if q_NKV is None else q_NKV.cpu(), lambda i0, i1: head.logits(last(i0, i1)).cpu(),
                 start, stop, end, temperature, counts, generator)


@torch.no_grad()
def evaluate_report(drafter, head, samples, spec, device, dtype, stages: dict[int, str] | None = None,
                    temperature: float = 0.0, draft_mode: str = "greedy", seed: int = 0,
                    max_generated: int | None = None, static=None) -> AcceptanceReport:
    """Offline acceptance over held-out FeatureSamples (one row per pass), in total and per stage. spec: what the
    samples ship (a FeatureSpec; layer ids mean whole rows of those layers).

    static: a run's fixed shapes (specdistill/core/shapes.py): where static.pad, each row is laid out over a length
    bucket (StaticShapes.walk_tokens, at most static.tokens), so the held-out walks compile a few shapes, not one
    per row, and a 2k-position row does not pay for a 32k pack."""
    if draft_mode not in DRAFT_MODES:
        raise ValueError(f"draft_mode={draft_mode!r}; valid: {', '.join(DRAFT_MODES)}")
    K = drafter.num_speculative_tokens
    by_stage: dict[str, AcceptanceCounts] = {}
    was_training = drafter.training
    drafter.eval()
    for sample in samples:
        stage = (stages or {}).get(sample.row_id, NO_STAGE)
        counts = by_stage.setdefault(stage, AcceptanceCounts(K=K))
        shipped = sample.num_tokens - sample.context_start
        pad_to = static.walk_tokens(shipped) if static is not None and static.pad else None
        # The row crosses to the device as it is, its padding is made there, and its states are cast there.
        batch = replace(pack([sample.to(device)], spec, pad_to).to(device, dtype), static=static)
        evaluate_sample(drafter, head, batch, counts, max_generated, temperature, draft_mode, seed)
    drafter.train(was_training)
    total = AcceptanceCounts(K=K)
    for counts in by_stage.values():
        total.merge(counts)
    return AcceptanceReport(total, by_stage, temperature, draft_mode)


def evaluate(drafter, head, samples, spec, device, dtype, max_generated: int | None = None) -> AcceptanceCounts:
    """Offline greedy acceptance over held-out FeatureSamples (what metrics.json's tau_offline reports)."""
    return evaluate_report(drafter, head, samples, spec, device, dtype, max_generated=max_generated).total
