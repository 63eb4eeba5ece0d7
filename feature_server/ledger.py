"""Trainer-side bookkeeping of one feature server's rows: which rank owns a row, and exactly-once delivery.

Row i of `rows` belongs to rank i % num_ranks (shard_rows, before skipping), so torchrun ranks see disjoint data
and a resumed run keeps the same assignment. The SampleLedger knows every row of a rank as pending, in flight
(handed to one worker) or done: a dead worker's in-flight rows go back to the front of the queue, a late copy of a
row already done is dropped and counted, never delivered twice, and every sample that crossed the process boundary
is checked (shape, dtype, tokens, membership) before it is.
"""

from collections import deque
from collections.abc import Sequence

import torch

from core.contract import FeatureSample, FeatureSpec, TokenizedRow
from feature_server.shm_transport import Received


class FeatureWorkerError(RuntimeError):
    """A feature worker failed (exception, or died without a word and could not be replaced)."""


def shard_rows(rows: Sequence[TokenizedRow], shard: int, num_shards: int) -> list[TokenizedRow]:
    """Round-robin by position: balanced, and independent of which rows a resumed run skips."""
    return list(rows[shard::num_shards])


class SampleLedger:
    """Trainer-side bookkeeping of one stream (an epoch, a held-out set): every row of this rank is pending, in
    flight (with one worker) or done. Workers echo the stream id with every sample, so a late copy of a row from an
    earlier stream of the same server (its row ids recur every epoch) is dropped like any other duplicate."""

    def __init__(self, spec: FeatureSpec, rows: Sequence[TokenizedRow], stream: int = 0):
        self.spec, self.stream = spec, stream
        self.rows = {r.row_id: r for r in rows}
        self.pending = deque(r.row_id for r in rows)  # dataset order; reissued rows go to the front
        self.in_flight: dict[int, dict[int, None]] = {}  # worker -> row ids, in hand-out order
        self.owner: dict[int, int] = {}  # row id -> worker holding it
        self.done: set[int] = set()
        self.reissued = 0
        self.duplicates_dropped = 0
        self.hidden_size: int | None = None
        self.num_hidden_layers: int | None = None

    @property
    def complete(self) -> bool:
        return len(self.done) == len(self.rows)

    def outstanding(self, worker: int) -> int:
        return len(self.in_flight.get(worker, ()))

    def ready(self, worker: int, info: dict) -> None:
        dims = (info["num_hidden_layers"], info["hidden_size"])
        if self.hidden_size is not None and dims != (self.num_hidden_layers, self.hidden_size):
            raise FeatureWorkerError(f"feature worker {worker}: target has (layers, hidden) = {dims}, other "
                                     f"workers reported {(self.num_hidden_layers, self.hidden_size)}")
        self.num_hidden_layers, self.hidden_size = dims

    def assign(self, worker: int, n: int) -> list[TokenizedRow]:
        out = []
        while self.pending and len(out) < n:
            row_id = self.pending.popleft()
            self.in_flight.setdefault(worker, {})[row_id] = None
            self.owner[row_id] = worker
            out.append(self.rows[row_id])
        return out

    def accept(self, msg: Received) -> FeatureSample | None:
        """The checked sample, or None for a late duplicate of a row already done (counted)."""
        worker, row_id = msg.producer_id, msg.key
        if self.hidden_size is None:
            raise FeatureWorkerError(f"feature worker {worker}: row {row_id} arrived before any worker was ready")
        if msg.info.get("stream", self.stream) != self.stream:  # extracted for an earlier stream, delivered late
            self.duplicates_dropped += 1
            return None
        if row_id not in self.rows:
            raise FeatureWorkerError(f"feature worker {worker}: row {row_id} is not in this rank's rows")
        if row_id in self.done:
            self.duplicates_dropped += 1
            return None
        if set(msg.tensors) != {"input_ids_T", "loss_mask_T", "hidden_TLD"}:
            raise FeatureWorkerError(f"feature worker {worker}: row {row_id} carries fields {sorted(msg.tensors)}")
        sample = FeatureSample(row_id=row_id, **msg.tensors)
        sample.check(self.spec, self.hidden_size)
        if sample.loss_mask_T.dtype != torch.bool:  # FeatureSample.check leaves the mask dtype to us
            raise FeatureWorkerError(f"feature worker {worker}: row {row_id} loss mask is {sample.loss_mask_T.dtype}, "
                                     "expected torch.bool")
        row = self.rows[row_id]
        if not (torch.equal(sample.input_ids_T, torch.tensor(row.input_ids, dtype=torch.int64))
                and torch.equal(sample.loss_mask_T, torch.tensor(row.loss_mask, dtype=torch.bool))):
            raise FeatureWorkerError(f"feature worker {worker}: row {row_id} tokens or loss mask differ from "
                                     "the dataset row")
        holder = self.owner.pop(row_id, None)
        if holder is not None:
            del self.in_flight[holder][row_id]
        else:  # reissued after its worker was declared dead, then its first copy arrived after all
            self.pending.remove(row_id)
        self.done.add(row_id)
        return sample

    def worker_died(self, worker: int) -> list[int]:
        """Put a dead worker's in-flight rows back at the front of the queue; returns them."""
        ids = list(self.in_flight.pop(worker, {}))
        for row_id in ids:
            del self.owner[row_id]
        self.pending.extendleft(reversed(ids))
        self.reissued += len(ids)
        return ids

    def finished(self, worker: int) -> None:
        if self.outstanding(worker):
            missing = list(self.in_flight[worker])
            raise FeatureWorkerError(f"feature worker {worker} reported done, but rows {missing[:10]} "
                                     f"({len(missing)} in all) never arrived")
