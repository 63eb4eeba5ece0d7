"""FeatureFeed: the trainer's one server per run, packing ahead of the step (a fake in-process server, no workers)."""

import threading
import time

import pytest
import torch

from specdistill.core.contract import FeatureSample, TokenizedRow
from specdistill.trainer.feed import EpochEnd, FeatureFeed

LAYERS = (1, 2)


class FakeServer:
    """The FeatureServer surface the feed uses: samples made in-process, stream after stream."""

    def __init__(self, fail_on: int | None = None, slow_s: float = 0.0):
        self.streams, self.started, self.closed, self.cancelled = [], False, False, False
        self.fail_on, self.slow_s, self.samples = fail_on, slow_s, 0

    def start(self):
        self.started = True

    def select(self, rows, skip_row_ids=frozenset()):
        return rows.take([i for i, r in enumerate(rows.row_ids) if r not in skip_row_ids])

    def stream(self, rows, skip_row_ids=frozenset(), sharded=True):
        self.streams.append(sorted(r.row_id for r in rows if r.row_id not in skip_row_ids))
        for r in rows:
            if r.row_id in skip_row_ids:
                continue
            if r.row_id == self.fail_on:
                raise RuntimeError(f"feature worker 0 failed on row {r.row_id}")
            time.sleep(self.slow_s)
            self.samples += 1
            T = len(r.input_ids)
            yield FeatureSample(r.row_id, torch.tensor(r.input_ids), torch.tensor(r.loss_mask).bool(),
                                torch.full((T, len(LAYERS), 4), float(r.row_id)))

    def stats(self):
        return {"extract_wall_s_sum": 0.5 * self.samples, "rows_reissued": 0, "duplicates_dropped": 0,
                "workers_died": 0, "engine_loads": 1, "engine_loads_per_slot": {0: 1}}

    def cancel(self):
        self.cancelled = True

    def close(self):
        self.closed = True


def rows(n, first=0):
    return [TokenizedRow(first + i, (1, 2, 3, 4), (0, 0, 1, 1)) for i in range(n)]


def feed(server, data, **kw):
    settings = dict(token_budget=8, spec=LAYERS, grad_accum=1, prefetch=2, max_epochs=2)
    return FeatureFeed(lambda: server, data, **{**settings, **kw})


def drain(f):
    items = []
    while (item := f.next()) is not None:
        items.append(item)
    return items


def test_epochs_of_packs_then_an_end_marker_each_with_its_counts():
    server = FakeServer()
    with feed(server, rows(4)) as f:
        items = drain(f)
    ends = [i for i in items if isinstance(i, EpochEnd)]
    packs = [i for i in items if not isinstance(i, EpochEnd)]
    assert [e.epoch for e in ends] == [0, 1] and len(packs) == 4  # 2 rows of 4 tokens per 8-token pack
    assert [sorted(r for p in group for r in p.row_ids) for group in packs[:2]] == [[0, 1], [2, 3]]
    assert ends[0].counts["extract_wall_s_sum"] == 2.0 == ends[1].counts["extract_wall_s_sum"]  # per epoch
    assert server.started and server.closed and len(server.streams) == 2


def test_a_resume_at_an_epoch_boundary_ends_that_epoch_at_once_and_goes_on():
    """The checkpoint came after the last pack of epoch 1 and before its end was counted: epoch 1 has nothing
    left, so the feed reports its end first, then streams epoch 2 in full."""
    server = FakeServer()
    data = rows(4)
    with feed(server, data, max_epochs=3, start_epoch=1, skip_row_ids=frozenset(r.row_id for r in data)) as f:
        items = drain(f)
    assert isinstance(items[0], EpochEnd) and items[0].epoch == 1
    assert server.streams == [[], [0, 1, 2, 3]] and isinstance(items[-1], EpochEnd) and items[-1].epoch == 2


def test_eval_rows_come_first_unsharded_and_are_own_copies():
    server = FakeServer()
    with feed(server, rows(2), eval_rows=rows(3, first=100)) as f:
        samples = f.eval_samples()
        assert sorted(s.row_id for s in samples) == [100, 101, 102]
        drain(f)
    assert server.streams[0] == [100, 101, 102]


def test_a_worker_error_reaches_the_training_loop():
    with feed(FakeServer(fail_on=3), rows(4)) as f:
        with pytest.raises(RuntimeError, match="failed on row 3"):
            drain(f)


def test_an_error_before_the_eval_rows_reaches_the_trainer_too():
    with feed(FakeServer(fail_on=101), rows(2), eval_rows=rows(3, first=100)) as f:
        with pytest.raises(RuntimeError, match="failed on row 101"):
            f.eval_samples()


def test_the_queue_holds_prefetch_steps_and_close_stops_a_blocked_feed():
    """The feed runs ahead by `prefetch` steps, no more; close() returns while it is blocked on the full queue."""
    server = FakeServer()
    f = feed(server, rows(40), prefetch=3, max_epochs=1).start()
    deadline = time.monotonic() + 10
    while f._queue.qsize() < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)
    # 3 packs queued and a 4th waiting to be queued: its last sample completed it, nothing was read beyond.
    assert f._queue.qsize() == 3 and server.samples == 2 * (3 + 1)
    closer = threading.Thread(target=f.close)
    closer.start()
    closer.join(5)
    assert not closer.is_alive() and server.closed
    assert f.final_counts["extract_wall_s_sum"] == 0.5 * server.samples  # the epoch in progress is still counted


def test_prefetch_must_be_positive():
    with pytest.raises(ValueError, match="trainer.prefetch_steps=0"):
        feed(FakeServer(), rows(2), prefetch=0)


def test_rows_of_varying_length_give_only_the_planned_shapes_when_padded():
    """Fixed shapes (core/shapes.py): packs of rows of any length come out laid over the token budget, and the
    anchor-block attention of every pack (DFlash's anchors: its response tokens) sees one of the planned shapes."""
    from specdistill.core.shapes import StaticShapes, anchor_bucket
    from specdistill.kernels.attention import anchor_block_plan

    g = torch.Generator().manual_seed(0)
    budget, B, max_anchors = 1024, 8, 256
    data = []
    for i in range(60):
        n, r = int(torch.randint(60, 400, (1,), generator=g)), int(torch.randint(2, 60, (1,), generator=g))
        data.append(TokenizedRow(i, tuple(range(n)), (0,) * (n - r) + (1,) * r))
    static = StaticShapes(tokens=budget, pad=True)
    with feed(FakeServer(), data, token_budget=budget, max_epochs=1, pad_to=budget) as f:
        packs = [p for item in drain(f) if not isinstance(item, EpochEnd) for p in item]
    real = [p.num_real_tokens for p in packs]
    assert {p.num_tokens for p in packs} == {budget} and sum(real) == sum(len(r.input_ids) for r in data)
    assert len(set(real)) > 1  # the packs' own lengths vary
    for p in packs:
        pad_doc = p.document_ids_T[-1]
        assert not p.loss_mask_T[p.document_ids_T == pad_doc].any() and int(pad_doc) == len(p.row_ids)
        anchors = torch.nonzero(p.loss_mask_T).squeeze(-1)[:max_anchors]
        anchor_block_plan(p.document_ids_T, anchors, B, None, False, impl="chunked", static=static)
    planned = {("anchor_block", b * B, budget + b * B, B, None, False, True)  # True: with autograd (training)
               for b in {anchor_bucket(n) for n in range(max_anchors + 1)}}
    assert static.seen <= planned and 1 <= static.count < len(packs)


def test_an_epochs_counts_queued_but_never_read_reach_the_final_counts():
    """A run that stops at max_steps right after an epoch's last pack never reads that epoch's EpochEnd: its counts
    (extraction seconds) must still reach the trainer, through final_counts (they used to be lost: 0.0 s)."""
    server = FakeServer()
    f = feed(server, rows(4), max_epochs=1).start()
    packs = [f.next(), f.next()]  # the epoch's two packs; its EpochEnd stays queued
    assert all(isinstance(p, list) for p in packs)
    deadline = time.monotonic() + 10
    while f._queue.qsize() < 2 and time.monotonic() < deadline:  # EpochEnd and the None after it
        time.sleep(0.01)
    f.close()
    assert f.final_counts["extract_wall_s_sum"] == 0.5 * server.samples == 2.0


def test_an_epochs_counts_kept_from_a_full_queue_by_close_reach_the_final_counts():
    """The same when the EpochEnd never got into the queue: it waited for room behind packs the run did not take."""
    server = FakeServer()
    f = feed(server, rows(4), max_epochs=1, prefetch=1).start()
    first = f.next()  # 2 packs: one read, one queued; the EpochEnd after them waits for room and never queues
    deadline = time.monotonic() + 10
    while server.samples < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)
    f.close()
    assert isinstance(first, list) and f.final_counts["extract_wall_s_sum"] == 0.5 * server.samples == 2.0
