"""Trainer-side bookkeeping of one feature server's rows: which rank owns a row, and exactly-once delivery.

Row i of `rows` belongs to rank i % num_ranks (shard_rows, before skipping), so torchrun ranks see disjoint data
and a resumed run keeps the same assignment. The SampleLedger knows every row of a rank as pending, in flight
(handed to one worker) or done: a dead worker's in-flight rows go back to the front of the queue, a late copy of a
row already done is dropped and counted, never delivered twice, and every sample that crossed the process boundary
is checked (shape, dtype, tokens, membership) before it is.
"""

from collections import deque
from collections.abc import Sequence

import numpy as np
import torch

from specdistill.core.contract import FeatureSample, FeatureSpec, TokenizedRow, sample_fields
from specdistill.core.rows import Rows, as_rows, check_unique_ids
from specdistill.feature_server.shm_transport import Received


class FeatureWorkerError(RuntimeError):
    """A feature worker failed (exception, or died without a word and could not be replaced)."""


def shard_rows(rows: "Rows | Sequence[TokenizedRow]", shard: int, num_shards: int) -> Rows:
    """Round-robin by position: balanced, and independent of which rows a resumed run skips."""
    rows = as_rows(rows)
    return rows.take(np.arange(shard, len(rows), num_shards))


class SampleLedger:
    """Trainer-side bookkeeping of one stream (an epoch, a held-out set): every row of this rank is pending, in
    flight (with one worker) or done. Workers echo the stream id with every sample, so a late copy of a row from an
    earlier stream of the same server (its row ids recur every epoch) is dropped like any other duplicate.

    Memory is an index, not rows: pending rows are a cursor into `rows` plus the few a dead worker gave back,
    done is a bit per row, and a row's tokens are read (rows.by_id) only to hand it out or check its sample."""

    def __init__(self, spec: FeatureSpec, rows: "Rows | Sequence[TokenizedRow]", stream: int = 0):
        self.spec, self.stream = spec, stream
        self.rows = as_rows(rows)
        check_unique_ids(self.rows)
        self._cursor = 0  # rows[cursor:] were never handed out, in order
        self._front: deque[int] = deque()  # positions a dead worker gave back; handed out first
        self.in_flight: dict[int, dict[int, int]] = {}  # worker -> row id -> position, in hand-out order
        self._tokens_out: dict[int, int] = {}  # worker -> tokens in flight
        self.owner: dict[int, int] = {}  # row id -> worker holding it
        self._done_P = np.zeros(len(self.rows), dtype=bool)
        self.num_done = 0
        self.reissued = 0
        self.duplicates_dropped = 0
        self.hidden_size: int | None = None
        self.num_hidden_layers: int | None = None

    @property
    def complete(self) -> bool:
        return self.num_done == len(self.rows)

    @property
    def has_pending(self) -> bool:
        return bool(self._front) or self._cursor < len(self.rows)

    @property
    def pending(self) -> list[int]:
        """Row ids not handed out, in hand-out order (for tests and messages)."""
        return [int(self.rows.row_ids[p]) for p in self._front] + self.rows.row_ids[self._cursor:].tolist()

    @property
    def done(self) -> set[int]:
        return set(self.rows.row_ids[self._done_P].tolist())

    def outstanding(self, worker: int) -> int:
        return len(self.in_flight.get(worker, ()))

    def outstanding_tokens(self, worker: int) -> int:
        return self._tokens_out.get(worker, 0)

    def ready(self, worker: int, info: dict) -> None:
        dims = (info["num_hidden_layers"], info["hidden_size"])
        if self.hidden_size is not None and dims != (self.num_hidden_layers, self.hidden_size):
            raise FeatureWorkerError(f"feature worker {worker}: target has (layers, hidden) = {dims}, other "
                                     f"workers reported {(self.num_hidden_layers, self.hidden_size)}")
        self.num_hidden_layers, self.hidden_size = dims

    def assign(self, worker: int, n: int) -> list[TokenizedRow]:
        """Hand the next `n` pending rows to `worker`."""
        out = []
        while self.has_pending and len(out) < n:
            out.append(self._hand_out(worker))
        return out

    def _hand_out(self, worker: int) -> TokenizedRow:
        if self._front:
            position = self._front.popleft()
        else:
            position, self._cursor = self._cursor, self._cursor + 1
        row_id = int(self.rows.row_ids[position])
        self.in_flight.setdefault(worker, {})[row_id] = position
        self._tokens_out[worker] = self.outstanding_tokens(worker) + int(self.rows.num_tokens[position])
        self.owner[row_id] = worker
        return self.rows[position]

    def accept(self, msg: Received) -> FeatureSample | None:
        """The checked sample, or None for a late duplicate of a row already done (counted)."""
        worker, row_id = msg.producer_id, msg.key
        if self.hidden_size is None:
            raise FeatureWorkerError(f"feature worker {worker}: row {row_id} arrived before any worker was ready")
        if msg.info.get("stream", self.stream) != self.stream:  # extracted for an earlier stream, delivered late
            self.duplicates_dropped += 1
            return None
        try:
            position = self.rows.position_of(row_id)
        except KeyError:
            raise FeatureWorkerError(f"feature worker {worker}: row {row_id} is not in this rank's rows") from None
        if self._done_P[position]:
            self.duplicates_dropped += 1
            return None
        fields = set(sample_fields(self.spec))
        if set(msg.tensors) != fields:
            raise FeatureWorkerError(f"feature worker {worker}: row {row_id} carries fields {sorted(msg.tensors)}, "
                                     f"expected {sorted(fields)}")
        spans = self.spec.row_spans(msg.tensors["loss_mask_T"])
        sample = FeatureSample(row_id=row_id, **msg.tensors, context_start=spans.context_start,
                               response_start=spans.response_start)
        sample.check(self.spec, self.hidden_size)
        if sample.loss_mask_T.dtype != torch.bool:  # FeatureSample.check leaves the mask dtype to us
            raise FeatureWorkerError(f"feature worker {worker}: row {row_id} loss mask is {sample.loss_mask_T.dtype}, "
                                     "expected torch.bool")
        row = self.rows[position]
        if not (torch.equal(sample.input_ids_T, torch.tensor(row.input_ids, dtype=torch.int64))
                and torch.equal(sample.loss_mask_T, torch.tensor(row.loss_mask, dtype=torch.bool))):
            raise FeatureWorkerError(f"feature worker {worker}: row {row_id} tokens or loss mask differ from "
                                     "the dataset row")
        holder = self.owner.pop(row_id, None)
        if holder is not None:
            del self.in_flight[holder][row_id]
            self._tokens_out[holder] -= int(self.rows.num_tokens[position])
        else:  # reissued after its worker was declared dead, then its first copy arrived after all
            self._front.remove(position)
        self._done_P[position] = True
        self.num_done += 1
        return sample

    def worker_died(self, worker: int) -> list[int]:
        """Put a dead worker's in-flight rows back at the front of the queue; returns them."""
        held = self.in_flight.pop(worker, {})
        for row_id in held:
            del self.owner[row_id]
        self._tokens_out.pop(worker, None)
        self._front.extendleft(reversed(list(held.values())))
        self.reissued += len(held)
        return list(held)

    def finished(self, worker: int) -> None:
        if self.outstanding(worker):
            missing = list(self.in_flight[worker])
            raise FeatureWorkerError(f"feature worker {worker} reported done, but rows {missing[:10]} "
                                     f"({len(missing)} in all) never arrived")
