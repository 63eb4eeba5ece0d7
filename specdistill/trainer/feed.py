"""The trainer's feature feed: one FeatureServer per run, driven by a thread that packs ahead of the training step.

The feed thread starts the server (its workers load the target once for the whole run), streams the held-out rows
first when there are any, then epoch after epoch of this rank's training rows. Each epoch's packs are planned from
the rows' lengths before any is extracted (specdistill/data/packing.py: best-fit over windows of rows, ~0.97+ of every pack
filled), the rows are streamed in plan order, and each sample is copied into its planned pack as it arrives
(specdistill/core/batch.py PackAssembler); complete packs go, an optimizer step's worth at a time, into a queue that holds
`prefetch` of them. While the training step runs, the next
packs are being extracted, copied out of the shared-memory rings and packed; the step waits only when the queue is
empty, i.e. when feature capacity is below demand (docs/scaling.md, "Prefetch").

On CUDA the packs are assembled in pinned buffers and their copy to the device is issued here, on a side stream, as
each pack completes (trainer/device_copy.py): the queue then holds StagedPacks. `pad_to` lays every pack out over
the run's token budget (the fixed shapes of specdistill/core/shapes.py).

The main thread takes items in order: a step's packs (a list of PackedBatch or StagedPack), an EpochEnd (the epoch's delivery
counts, after its last packs), or None when max_epochs are done. Exactly-once accounting stays with the main
thread, which records the rows it has trained on; rows packed ahead but not trained when a run stops are simply
extracted again after a resume. Workers die with the thread that started them (PR_SET_PDEATHSIG), so that thread
lives until the feed closes.
"""

import logging
import queue
import threading

import numpy as np
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from specdistill.core.batch import PackAssembler, PackedBatch, as_spec, shipped_tokens
from specdistill.core.contract import FeatureSample, FeatureSpec, TokenizedRow
from specdistill.core.rows import Rows, as_rows
from specdistill.data.packing import DEFAULT_WINDOW, plan_packs
from specdistill.feature_server.server import FeatureServer, StreamCancelled
from specdistill.trainer.device_copy import DeviceCopier, StagedPack

log = logging.getLogger(__name__)

# Server counters an epoch reports as deltas (specdistill/feature_server/server.py stats()).
EPOCH_COUNTERS = ("extract_wall_s_sum", "rows_reissued", "duplicates_dropped", "workers_died")
_PUT_POLL_S = 0.2  # how often a feed thread blocked on a full queue checks for close()


@dataclass
class EpochEnd:
    epoch: int
    counts: dict = field(default_factory=dict)  # EPOCH_COUNTERS over this epoch


@dataclass
class _Failed:
    error: BaseException


class FeatureFeed:
    """Packs of this rank's rows, `prefetch` optimizer steps ahead, epoch after epoch from one FeatureServer.

    make_server: builds the run's server (rows=None); called in the feed thread.
    eval_rows: rows extracted once before the first epoch, unsharded (rank 0's held-out and probe rows);
        `eval_samples()` returns them (own copies: they outlive the rings).
    start_epoch, skip_row_ids: where a resumed run picks up (rows of start_epoch already trained on).
    pad_to: every pack padded to this many tokens (None: packs as long as their rows).
    copier: on CUDA, pinned buffers and the side-stream copy of each pack (None: host packs, as on CPU).
    """

    def __init__(self, make_server: Callable[[], FeatureServer], rows: "Rows | Sequence[TokenizedRow]", *,
                 token_budget: int, spec: "FeatureSpec | tuple[int, ...]", grad_accum: int, prefetch: int, max_epochs: int,
                 start_epoch: int = 0, skip_row_ids: frozenset[int] = frozenset(),
                 eval_rows: Sequence[TokenizedRow] = (), pack_window: int = DEFAULT_WINDOW,
                 pad_to: int | None = None, copier: DeviceCopier | None = None):
        if prefetch < 1:
            raise ValueError(f"trainer.prefetch_steps={prefetch}: need >= 1 (the packs of the next step)")
        self._make_server, self._rows, self._eval_rows = make_server, as_rows(rows), list(eval_rows)
        self._window, self._pad_to, self._copier = pack_window, pad_to, copier
        self._budget, self._spec, self._grad_accum = token_budget, as_spec(spec), grad_accum
        self._max_epochs, self._start_epoch, self._skip = max_epochs, start_epoch, frozenset(skip_row_ids)
        self._queue: queue.Queue = queue.Queue(maxsize=prefetch)
        self._eval_done = threading.Event()
        self._eval_samples: list[FeatureSample] = []
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._server: FeatureServer | None = None
        self._counted = dict.fromkeys(EPOCH_COUNTERS, 0.0)  # server counters already reported
        self.final_counts: dict = {}  # counts the main thread never received, once closed (close())
        self._undelivered: dict = {}  # an EpochEnd's counts that close() kept from being queued
        self.server_stats: dict = {}  # the server's last stats (engine loads, streams), once closed
        self.max_open_packs = 0  # packs being assembled at once, at most (each holds a pack buffer: docs/scaling.md)
        self._thread = threading.Thread(target=self._run, name="feature-feed", daemon=True)

    # ---- main thread ---------------------------------------------------------------------------------
    def start(self) -> "FeatureFeed":
        self._thread.start()
        return self

    def eval_samples(self) -> list[FeatureSample]:
        """The eval rows' samples, once extracted (re-raises the feed's error if it failed first)."""
        while not self._eval_done.wait(_PUT_POLL_S):
            if not self._thread.is_alive():
                break
        if self._error is not None:
            raise self._error
        if not self._eval_done.is_set():
            raise RuntimeError("the feature feed stopped before the held-out rows were extracted")
        return self._eval_samples

    def next(self) -> "list[PackedBatch | StagedPack] | EpochEnd | None":
        """The next item, waiting for it; the feed thread's exception is re-raised here."""
        item = self._queue.get()
        if isinstance(item, _Failed):
            raise item.error
        return item

    def close(self) -> None:
        """Stop the feed thread and its server (workers stopped, segments swept); idempotent. `final_counts` then
        holds every count the main thread has not received: the epoch in progress, and an EpochEnd queued but never
        read (the run stopped at max_steps right after an epoch's last pack)."""
        self._stop.set()
        if self._server is not None:
            self._server.cancel()  # a stream waiting on a worker gives up at its next poll
        self._thread.join()
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, EpochEnd):
                for key, value in item.counts.items():
                    self.final_counts[key] = self.final_counts.get(key, 0) + value

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()

    # ---- feed thread ---------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._server = self._make_server()
            self._server.start()
            if self._stop.is_set():  # closed while the server was being built
                return
            self._extract_eval_rows()
            for epoch in range(self._start_epoch, self._max_epochs):
                skip = self._skip if epoch == self._start_epoch else frozenset()
                for group in _grouped(self._epoch_packs(skip), self._grad_accum):
                    if not self._put(group):
                        return
                end = EpochEnd(epoch, self._counts_since_last())
                if not self._put(end):
                    self._undelivered = end.counts  # closed while it waited for room: final_counts keeps them
                    return
            self._put(None)
        except StreamCancelled:
            pass  # close() while a stream waited on a worker
        except BaseException as e:  # to the main thread, which re-raises it with the worker's message
            self._error = e
            self._eval_done.set()
            self._put(_Failed(e), force=True)
        finally:
            if self._server is not None:
                since = self._counts_since_last()
                self.final_counts = {k: since[k] + self._undelivered.get(k, 0) for k in since}
                self._server.close()
                self.server_stats = self._server.stats()

    def _epoch_packs(self, skip: frozenset[int]):
        """This rank's rows of one epoch (minus `skip`), streamed in plan order and assembled into planned packs."""
        mine = self._server.select(self._rows, skip)
        # Planned by the positions each row ships (its context suffix), not its length
        packs = plan_packs(shipped_tokens(mine, self._spec), self._budget, self._window)
        ordered = mine.take(np.concatenate(packs) if packs else np.zeros(0, dtype=np.int64))
        buffers = {"buffers": self._copier.pool} if self._copier else {}
        assembler = PackAssembler(ordered, [len(p) for p in packs], self._spec, self._pad_to, **buffers)
        for sample in self._server.stream(ordered, sharded=False):
            pack = assembler.add(sample)
            self.max_open_packs = max(self.max_open_packs, assembler.open_packs + (pack is not None))
            if pack is not None:
                yield self._copier.stage(pack) if self._copier else pack

    def _extract_eval_rows(self) -> None:
        if self._eval_rows:
            for s in self._server.stream(self._eval_rows, sharded=False):  # cloned: views would pin the rings
                self._eval_samples.append(s.clone())
        self._eval_done.set()

    def _put(self, item, force: bool = False) -> bool:
        """Queue an item, blocking while the queue is full (the prefetch depth); False once close() was called."""
        while not self._stop.is_set() or force:
            try:
                self._queue.put(item, timeout=_PUT_POLL_S)
                return True
            except queue.Full:
                if force:  # the main thread may never read again; make room for the error
                    try:
                        self._queue.get_nowait()
                    except queue.Empty:
                        pass
        return False

    def _counts_since_last(self) -> dict:
        stats = self._server.stats()
        out = {k: stats[k] - self._counted[k] for k in EPOCH_COUNTERS}
        self._counted = {k: stats[k] for k in EPOCH_COUNTERS}
        return out


def _grouped(packs, n: int):
    """Lists of n consecutive packs (the last one of an epoch may be shorter)."""
    group = []
    for pack in packs:
        group.append(pack)
        if len(group) == n:
            yield group
            group = []
    if group:
        yield group
