"""The training loop: features stream in from the target workers, packs go through the drafters.

Read `train()` top to bottom: resume -> the feature feed (one feature server for the run, packing ahead of the
step: specdistill/trainer/feed.py) -> steps, epoch after epoch -> export -> offline evaluation -> metrics.json.
`_step()` is the whole training step: every drafter of the run (its entries, specdistill/trainer/entries.py; one
unless `drafters=[...]`) steps in turn on the same packs, so the target's prefill is paid once for all of them.
"""

import hashlib
import json
import logging
import math
import os
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import psutil
import torch
from tqdm import tqdm
from transformers import AutoTokenizer

from specdistill.core.batch import PackedBatch
from specdistill.core.contract import FeatureSpec
from specdistill.core.rows import as_rows
from specdistill.core.run_dir import RunDir
from specdistill.core.shapes import StaticShapes
from specdistill.core.target import TargetHead, TargetInfo
from specdistill.data.config import DataConfig
from specdistill.data.formats import check_tokenizer_matches
from specdistill.data.selection import check_skipped, load_selected
from specdistill.drafters import build_drafter
from specdistill.drafters.base import COMPUTE_MODES
from specdistill.feature_server.config import FeatureServerConfig
from specdistill.feature_server.ledger import shard_rows
from specdistill.feature_server.server import FeatureServer
from specdistill.trainer.layout import cpu_threads, cuda_device_count, plan_node
from specdistill.trainer import distributed, parallel
from specdistill.trainer.ablation import ablate, ablate_hidden, check_ablation
from specdistill.trainer.checkpoint import (SUMMED_OVER_RANKS, TrainState, load_latest_checkpoint, rank_entry,
                                           save_checkpoint)
from specdistill.trainer.config import TrainerConfig
from specdistill.trainer.consistency import check_same_start, dataset_fingerprint, prepared_state_hashes, run_settings
from specdistill.trainer.device_copy import DeviceCopier, StepPacks
from specdistill.trainer.entries import Entry, EntrySpec, resolve_entries
from specdistill.trainer.feed import EpochEnd, FeatureFeed
from specdistill.trainer.metrics import StepMetrics
from specdistill.trainer.optim import Optimizers
from specdistill.trainer.report import entry_metrics, run_metrics, summary_lines
from specdistill.trainer.tracking import Tracker
from specdistill.trainer.validation import ValidationState, Validator, check_eval_settings, resolve_eval_every, usable_heldout
from specdistill.evaluation.acceptance import target_row
from specdistill.evaluation.baselines import baseline_reports

# Probe rows (training rows walked beside the held-out ones) get ids past any file's line count, so one feature
# server can extract both sets without their row ids colliding in its exactly-once ledger.
PROBE_ROW_OFFSET = 1 << 40

log = logging.getLogger(__name__)


class Trainer:
    def __init__(self, drafter_cfg, trainer_cfg: TrainerConfig, server_cfg: FeatureServerConfig, run_dir: Path,
                 target_dir: Path, train_path: Path, heldout_path: Path | None, resolved_config: dict | None = None,
                 data_cfg: DataConfig | None = None, cache_dir: Path | None = None, entries: list | None = None):
        """entries: the run's `drafters=[...]` list (entries.py); None or empty: the one `drafter_cfg`."""
        self.launched = psutil.Process().create_time()  # first_step_seconds: this process's launch to its first step
        self.first_step_seconds: float | None = None
        self.cfg, self.server_cfg, self.run = trainer_cfg, server_cfg, RunDir(run_dir)
        self.dist = distributed.init_distributed(trainer_cfg.device, trainer_cfg.collective_timeout_s)
        # Before any other collective: every rank started (a rank whose start raised stops all of them with its
        # error) and loaded the same rows, tokenizer, target, settings, versions and drafter vocabularies
        # (specdistill/trainer/consistency.py, docs/launching.md "Many nodes, one dataset").
        try:
            check_same_start(self.dist, lambda: self._start(drafter_cfg, target_dir, train_path, heldout_path,
                                                            resolved_config, data_cfg, cache_dir, entries))
        except Exception:
            distributed.close(self.dist)  # every rank stops here
            raise
        for entry in self.entries:
            self._wrap(entry)
        # CUDA: packs assembled in pinned memory and copied ahead of the step on a side stream (device_copy.py)
        self.copier = DeviceCopier(self.dist.device) if self.dist.device.type == "cuda" else None
        self.meta = {"model_type": self.target.model_type,  # what a resume checks and evaluation/reload.py builds
                     "drafters": {e.name: e.record() for e in self.entries}}
        # Stable per run and rank, so a crashed run's leftover segments are swept when it resumes.
        run_key = hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:10]
        self.shm_prefix = f"specdistill_{run_key}_r{self.dist.rank}"
        self.tracker = Tracker.from_run_config(resolved_config or {}, run_dir, enabled=self.dist.is_main)

    def _start(self, drafter_cfg, target_dir: Path, train_path: Path, heldout_path: Path | None,
               resolved_config: dict | None, data_cfg: DataConfig | None, cache_dir: Path | None,
               entries: list | None) -> dict:
        """This rank's start, up to its first collective: settings checked, target and data loaded, drafters built
        and prepared (not wrapped). Returns the fingerprint of what it loaded (consistency.py)."""
        trainer_cfg, server_cfg = self.cfg, self.server_cfg
        self.layout = plan_node(trainer_cfg.ranks, server_cfg.workers, trainer_cfg.device, server_cfg.device,
                                cuda_device_count(), server_cfg.share_trainer_device)
        if trainer_cfg.grad_accum < 1:
            raise ValueError(f"trainer.grad_accum={trainer_cfg.grad_accum}: need >= 1 pack per optimizer step")
        check_eval_settings(trainer_cfg.eval_every or 0, trainer_cfg.max_steps, trainer_cfg.export)
        self.eval_every = resolve_eval_every(trainer_cfg.eval_every, trainer_cfg.max_steps)
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        if local_ranks != trainer_cfg.ranks:
            raise ValueError(f"trainer.ranks={trainer_cfg.ranks}, but {local_ranks} trainer processes run on this node; "
                             "start them with `specdistill-train` (it starts the ranks itself), or pass "
                             f"trainer.ranks=<torchrun --nproc-per-node>")
        parallel.check_mode(trainer_cfg.parallel)
        if trainer_cfg.compute not in COMPUTE_MODES:
            raise ValueError(f"trainer.compute={trainer_cfg.compute!r}; valid: {', '.join(COMPUTE_MODES)}")
        threads = cpu_threads(trainer_cfg.threads, self.dist.device.type, trainer_cfg.ranks)
        if threads is not None:
            torch.set_num_threads(threads)
            log.info("trainer rank %d: %d CPU threads (trainer.threads)", self.dist.rank, threads)
        torch.manual_seed(trainer_cfg.seed)
        self.target = TargetInfo.load(target_dir)
        self._tokenizer = AutoTokenizer.from_pretrained(str(target_dir), local_files_only=True)
        check_tokenizer_matches(self._tokenizer, {"vocab_size": self.target.vocab_size})
        specs = resolve_entries(entries or [], drafter_cfg, trainer_cfg)
        # Built before the data: what they read (their FeatureSpecs) decides which rows fit a pack. Prepared on the
        # rows once those are loaded (_build_entry).
        built = [self._built_drafter(spec.drafter) for spec in specs]
        # The feature server ships the union of the entries' layers and positions once; each drafter takes its own.
        self.spec = FeatureSpec.union([d.feature_spec() for d in built], server_cfg.hidden_dtype, server_cfg.positions)
        self.spec.check_against(self.target.num_hidden_layers)
        log.info("feature stream: %s", self.spec.describe())
        self._load_data(target_dir, train_path, heldout_path, data_cfg or DataConfig(),
                        Path(cache_dir or os.environ.get("SPECDISTILL_CACHE", ".cache/specdistill")))
        self.head = TargetHead(self.target).to(self.dist.device)
        self.autocast_dtype = _autocast_dtype(trainer_cfg.precision, self.dist.device)
        self.pad_packs = _pad_packs(trainer_cfg.pad_packs, self.dist.device, len(specs))
        self.several = bool(entries)  # drafters=[...]: export/<name>/ and per-drafter metrics, even for one entry
        self.entries = [self._build_entry(spec, drafter) for spec, drafter in zip(specs, built)]
        _check_feature_capacity(server_cfg, self.layout.workers_per_rank, self.pack_tokens, self.spec,
                                self.target.hidden_size)
        return dataset_fingerprint(
            target_dir, {"train": (train_path, self.rows), "heldout": (heldout_path, self.heldout_rows)},
            [(f"{e.name}.{n}", h) for e in self.entries for n, h in prepared_state_hashes(e.drafter)],
            self.dist.rank, run_settings(server_cfg.backend, server_cfg.hidden_dtype, resolved_config))

    def _built_drafter(self, drafter_cfg):
        """A drafter as its solo run builds it (the global RNG reseeded with trainer.seed first), not yet prepared."""
        torch.manual_seed(self.cfg.seed)
        drafter = build_drafter(drafter_cfg, self.target, self._tokenizer)
        drafter.compute = self.cfg.compute
        return drafter

    def _build_entry(self, spec: EntrySpec, drafter) -> Entry:
        """One drafter as its solo run would start it: built (_built_drafter), prepared on the training rows, its own
        generator seeded as a solo run's (seed + rank). Wrapped, and given its own optimizers and schedule, once the
        dataset check has passed (_wrap)."""
        drafter = self._prepared(drafter, spec.drafter)
        check_ablation(spec.trainer.feature_ablation, drafter.input_layer_ids(), self.target.num_hidden_layers)
        K = drafter.num_speculative_tokens
        return Entry(spec, drafter, drafter, None,
                     torch.Generator().manual_seed(self.cfg.seed + self.dist.rank), drafter.input_layer_ids(),
                     StaticShapes(tokens=self.pack_tokens, pad=self.pad_packs), StepMetrics(K), StepMetrics(K),
                     StepMetrics(K))

    def _wrap(self, entry: Entry) -> None:
        """What the step calls: the drafter spread over the ranks (collectives: DDP's setup broadcasts rank 0's
        weights and buffers, FSDP shards them in place), compiled if asked; its optimizers over the result."""
        model = parallel.wrap(entry.drafter, self.cfg.parallel, self.dist)
        entry.model = torch.compile(model) if self.cfg.compile else model
        entry.optimizers = Optimizers(entry.drafter, entry.spec.trainer, parallel.optimizer_group(self.dist))

    def _load_data(self, target_dir: Path, train_path: Path, heldout_path: Path | None, data_cfg: DataConfig,
                   cache_dir: Path) -> None:
        """The training and held-out rows from their token stores (tokenized once per node, memory-mapped), cut or
        skipped to fit a pack (specdistill/data/selection.py); stops here when too many rows would be skipped."""
        # A pack holds trainer.token_budget positions of rows laid end to end: what each row ships (self.spec). The
        # target prefills a row whole, so a row must fit its context; a row whose context layers ship whole must fit
        # a pack too, while a windowed-only run takes rows longer than a pack whose shipped positions fit one
        # (specdistill/data/selection.py; docs/scaling.md "What ships").
        self.pack_tokens = self.cfg.token_budget
        window = self.spec.context_window
        progress = self.cfg.progress and self.dist.is_main
        self.rows, self.train_skips, store = load_selected(train_path, target_dir, cache_dir, self.cfg.token_budget,
                                                           data_cfg, progress, window)
        check_skipped(store, self.train_skips, data_cfg.max_skipped_fraction,
                      min(self.target.max_position_embeddings, self.cfg.token_budget), data_cfg.truncate,
                      self.target.max_position_embeddings)
        if not len(self.rows):
            raise ValueError(f"{train_path}: no trainable rows ({self.train_skips.summary()})")
        log.info("train rows: %s", self.train_skips.summary())
        self.heldout_rows, self.heldout_skips, self.heldout_stages = as_rows([]), None, {}
        if heldout_path:
            held, self.heldout_skips, held_store = load_selected(heldout_path, target_dir, cache_dir,
                                                                 self.cfg.token_budget, data_cfg, progress, window)
            if not len(held):
                raise ValueError(f"{heldout_path}: no usable held-out row ({self.heldout_skips.summary()}); held-out "
                                 "rows need response tokens (loss_mask 1) and must fit trainer.token_budget")
            self.heldout_rows = usable_heldout(held, heldout_path)  # an index into the store, like the training rows
            self.heldout_stages = held_store.stages_by_row_id()
        self.heldout_path = heldout_path
        # The longest row the target prefills (the vLLM engine's max_model_len - 1): the longest row selected.
        self.row_tokens = int(max(self.rows.num_tokens.max(), self.heldout_rows.num_tokens.max(initial=0)))

    @property
    def _label(self) -> str:
        return "+".join(e.name for e in self.entries)

    def _active(self) -> list[Entry]:
        return [e for e in self.entries if e.active]

    # --- the loop --------------------------------------------------------------------------------
    def train(self) -> dict:
        try:
            return self._train()
        finally:
            distributed.close(self.dist)  # on errors too: a rank must exit, or the launcher waits for it

    def _train(self) -> dict:
        state = self._resume()
        heldout, probe = self._eval_rows()
        self.feed = self._make_feed(state, heldout + probe)
        try:
            self._make_validators(heldout, probe)
            bar = tqdm(total=self.cfg.max_steps, initial=state.step,
                       disable=not (self.cfg.progress and self.dist.is_main), desc=f"train {self._label}", unit="step")
            if self.eval_every:
                for entry in self.entries:
                    if not entry.validation.curve:  # step 0: the untrained (for MTP, the target's own) drafter
                        self._validate(entry, state)
            self._loop(state, bar)
            bar.close()
        finally:
            self._close_feed(state)  # on errors too: its workers stop, its counts are kept
        for entry in self.entries:
            # Rank 0 holds the curve; every rank validates with it (a collective under fsdp).
            if distributed.gather_objects(self._curve_ends_before(entry, state.step), self.dist)[0]:
                self._validate(entry, state)  # the final weights are candidates for the export too
        self._save(state)
        return self._finish(state)

    def _loop(self, state: TrainState, bar) -> None:
        while state.step < self.cfg.max_steps:
            waited = time.perf_counter()
            micro = self._next_step_packs(state)
            state.feature_wait_seconds += time.perf_counter() - waited
            # Ranks pack their own shards, so one may run out of epochs (max_epochs) a step or two before the
            # others; they stop together, or the others would wait forever in the gradient all-reduce.
            if not distributed.all_ranks(micro is not None, self.dist):
                log.info("step %d: stopping, a rank has no rows left (trainer.max_epochs=%d)", state.step,
                         self.cfg.max_epochs)
                break
            self._step(micro, state)
            if self.first_step_seconds is None:
                self.first_step_seconds = time.time() - self.launched
            bar.update(1)
            shown = self._active()[0]
            train_tau = shown.window.tau_estimate  # before _log starts a new window
            if state.step % self.cfg.log_every == 0:
                self._log(state)
            if self.eval_every and state.step % self.eval_every == 0:
                for entry in self._active():
                    self._validate(entry, state)
            bar.set_postfix(loss=f"{shown.last_loss:.3f}", tau=f"{train_tau:.2f}",
                            heldout_tau=self._last_heldout_tau(shown))
            if state.step % self.cfg.checkpoint_every == 0:
                self._save(state)

    def _make_feed(self, state: TrainState, eval_rows: list) -> FeatureFeed:
        """The run's feature feed, from where a resumed run stopped (its epoch, minus the rows trained on)."""
        return FeatureFeed(self._run_server, self.rows, token_budget=self.pack_tokens,
                           spec=self.spec, grad_accum=self.cfg.grad_accum,
                           prefetch=self.cfg.prefetch_steps, max_epochs=self.cfg.max_epochs, start_epoch=state.epoch,
                           skip_row_ids=frozenset(state.consumed_row_ids), eval_rows=eval_rows,
                           pad_to=self.pack_tokens if self.pad_packs else None, copier=self.copier).start()

    def _next_step_packs(self, state: TrainState) -> list | None:
        """The next optimizer step's packs (trainer.grad_accum of them); None once max_epochs are done."""
        while isinstance(item := self.feed.next(), EpochEnd):
            self._end_epoch(state, item)
        return item

    def _end_epoch(self, state: TrainState, end: EpochEnd) -> None:
        self._add_delivery_counts(state, end.counts)
        # Every row of this rank must have been trained on exactly once by now.
        mine = shard_rows(self.rows, self.dist.rank, self.dist.world_size).row_ids
        consumed = np.fromiter(state.consumed_row_ids, dtype=np.int64, count=len(state.consumed_row_ids))
        lost = mine[~np.isin(mine, consumed)]
        if len(lost):
            log.error("epoch %d: %d rows never reached the trainer, e.g. %s", state.epoch, len(lost), lost[:10].tolist())
        state.samples_lost += len(lost)
        state.epoch += 1
        state.consumed_row_ids.clear()

    def _close_feed(self, state: TrainState) -> None:
        self.feed.close()
        self._add_delivery_counts(state, self.feed.final_counts)  # the epoch in progress, if the run stopped in it
        stats = self.feed.server_stats
        state.target_tokens += int(stats.get("tokens", 0))
        slots = max(1, len(stats.get("engine_loads_per_slot", {})))
        self.engine_loads_per_worker = stats.get("engine_loads", 0) / slots

    @staticmethod
    def _add_delivery_counts(state: TrainState, counts: dict) -> None:
        if not counts:
            return
        state.feature_seconds += counts["extract_wall_s_sum"]
        state.rows_reissued += int(counts["rows_reissued"])
        state.duplicate_deliveries_dropped += int(counts["duplicates_dropped"])
        state.feature_workers_died += int(counts["workers_died"])

    def _step(self, micro: list, state: TrainState) -> None:
        """One optimizer step of every drafter still training, in turn, over the same `trainer.grad_accum` packs
        (host packs, or packs already being copied to the device: trainer/device_copy.py), read-only."""
        started = time.perf_counter()
        micro = [micro] if isinstance(micro, PackedBatch) else micro
        packs = StepPacks(micro, self.dist.device, *self._micro_batches(len(micro)))
        for entry in self._active():
            entry_started = time.perf_counter()
            self._step_entry(entry, packs, state)
            entry.train_seconds += time.perf_counter() - entry_started
        if not self._active():  # the run fails only when no drafter is left
            raise FloatingPointError("; ".join(f"{e.name}: {e.stopped['why']}" for e in self.entries) +
                                     f". Nothing was written for this step; the last checkpoint is step "
                                     f"{state.step // self.cfg.checkpoint_every * self.cfg.checkpoint_every}")
        for batch in packs.items:
            self._count_batch(batch, state)
        state.step += 1
        state.train_seconds += time.perf_counter() - started
        state.last_loss = self._active()[0].last_loss

    def _micro_batches(self, mine: int) -> tuple[int, float]:
        """(micro-batches every rank runs this step, the weight of a pack's loss). Every rank runs as many as the
        rank with most: a rank's last group of an epoch may be shorter than another's, and each micro-batch makes
        collectives (FSDP's gathers, the loss agreement). Each pack weighs 1 / (the step's packs over all ranks),
        times the ranks, which DDP/FSDP average over: every pack counts the same, however they are spread."""
        if not self.dist.enabled or self.cfg.grad_accum == 1:
            return mine, 1 / mine
        counts = distributed.gather_objects(mine, self.dist)
        return max(counts), self.dist.world_size / sum(counts)

    def _step_entry(self, entry: Entry, packs: "StepPacks", state: TrainState) -> None:
        """One drafter's optimizer step: the mean of its losses over the packs, so 1 rank x N packs and N ranks x 1
        pack (DDP averages) take the same step. A non-finite loss, or finite loss with non-finite gradients, on any
        rank stops this drafter on every rank before the poisoned update reaches its weights; the others go on."""
        entry.optimizers.set_step(state.step)
        losses = []
        for i in range(packs.steps):
            real = i < len(packs.items)  # past them: this rank repeats its last pack at weight 0 (_micro_batches)
            batch = ablate(replace(packs[min(i, len(packs.items) - 1)], static=entry.static),
                           entry.cfg.feature_ablation, entry.input_layer_ids, entry.generator)
            # Gradients are reduced over the ranks once, on the last micro-batch.
            with parallel.gradient_sync(entry.model, self.cfg.parallel, self.dist, sync=i == packs.steps - 1):
                with torch.autocast(self.dist.device.type, dtype=self.autocast_dtype or torch.float32,
                                    enabled=self.autocast_dtype is not None):
                    out = entry.model(batch, self.head, entry.generator)
                if not distributed.all_ranks(bool(torch.isfinite(out.loss)), self.dist):
                    self._stop_entry(entry, batch, state, out.loss)
                    return
                (out.loss * (packs.weight if real else 0.0)).backward()
            if real:
                entry.packs += 1
                losses.append(float(out.loss.detach()))
                for metrics in (entry.window, entry.totals, entry.since_validation):
                    metrics.add(out)
            del batch, out  # the next micro-batch's fp32 cast is then the only one
        if not entry.optimizers.clip_step_and_zero(entry.drafter.parameters(), entry.cfg.grad_clip,
                                                   agree=lambda finite: distributed.all_ranks(finite, self.dist)):
            self._stop_entry(entry, None, state, torch.tensor(sum(losses) / len(losses)))
            return
        entry.steps += 1
        entry.last_loss = sum(losses) / len(losses)

    def _count_batch(self, batch: PackedBatch, state: TrainState) -> None:
        state.train_tokens += batch.num_real_tokens  # padding is not counted (core/batch.py)
        state.packs += 1
        state.train_rows += len(batch.row_ids)
        state.train_response_tokens += int(batch.loss_mask_T.sum())
        # The states the workers shipped for these rows, fp8 scales included (token ids and masks, 9 bytes a token,
        # left out)
        position_layers = (batch.num_real_tokens * len(batch.layer_ids)
                           + batch.num_response_positions * len(batch.response_layer_ids))
        state.feature_bytes += position_layers * self.spec.bytes_per_state(self.target.hidden_size)
        seen_twice = state.consumed_row_ids.intersection(batch.row_ids)
        if seen_twice or len(set(batch.row_ids)) != len(batch.row_ids):
            log.error("step %d: rows %s reached the trainer twice this epoch", state.step + 1, sorted(seen_twice)[:10])
            state.samples_duplicated += len(seen_twice) + len(batch.row_ids) - len(set(batch.row_ids))
        state.consumed_row_ids.update(batch.row_ids)

    def _stop_entry(self, entry: Entry, batch: PackedBatch | None, state: TrainState, loss: torch.Tensor) -> None:
        """A drafter whose loss (or, batch None, whose gradients) went non-finite on some rank stops here on every
        rank, its weights those of its last finite step; recorded with the step, its last finite loss and, from the
        first rank where it went wrong, the loss, the rows and whether the target's states were finite."""
        entry.optimizers.zero_grad()
        mine = {"rank": self.dist.rank, "loss": float(loss.detach())}
        if batch is not None:
            finite_T = torch.isfinite(batch.hidden_TLD).flatten(1).all(-1)
            bad_docs = batch.document_ids_T[~finite_T].unique().tolist()
            mine |= {"rows": list(batch.row_ids),
                     "bad_rows": [batch.row_ids[d] for d in bad_docs if d < len(batch.row_ids)]}  # not the padding
        seen = distributed.gather_objects(mine, self.dist)  # every rank stops here together
        bad = next((r for r in seen if not math.isfinite(r["loss"])), seen[0])
        if batch is None:
            where = "the loss is finite but its gradients are not (their norm is inf/nan; lower trainer.lr / muon_lr?)"
            why = f"step {state.step + 1}: {where}"
        else:
            where = (f"non-finite target hidden states in rows {bad['bad_rows']}" if bad["bad_rows"] else
                     "the target's hidden states are finite, so the drafter diverged (lower trainer.lr / muon_lr?)")
            on_rank = f" on rank {bad['rank']}" if self.dist.enabled else ""
            why = f"step {state.step + 1}: loss is {bad['loss']}{on_rank} on rows {bad['rows']}; {where}"
        entry.stopped = {"step": state.step + 1, "last_finite_loss": entry.last_loss, "loss": bad["loss"],
                         "why": why, "train_tokens": state.train_tokens}
        left = [e.name for e in self._active()]
        log.error("drafter %s stopped: %s%s", entry.name, why, f" (still training: {left})" if left else "")
        self.tracker.log({"step": state.step + 1, f"{entry.name}/stopped": 1})

    # --- pieces ----------------------------------------------------------------------------------
    def _server(self, rows, skip=frozenset(), sharded: bool = True) -> FeatureServer:
        """A one-pass server over this rank's shard of `rows` (sharded=False: all of them), for tools and tests."""
        rank, num_ranks = (self.dist.rank, self.dist.world_size) if sharded else (0, 1)
        return FeatureServer(self.target.path, self.spec, rows, self.server_cfg,
                             devices=self.layout.worker_devices[self.dist.local_rank], rank=rank, num_ranks=num_ranks,
                             skip_row_ids=frozenset(skip), max_row_tokens=self.row_tokens, shm_prefix=self.shm_prefix)

    def _run_server(self) -> FeatureServer:
        """The run's server (this rank's workers, fed stream after stream by specdistill/trainer/feed.py)."""
        return FeatureServer(self.target.path, self.spec, None, self.server_cfg,
                             devices=self.layout.worker_devices[self.dist.local_rank], rank=self.dist.rank,
                             num_ranks=self.dist.world_size, max_row_tokens=self.row_tokens,
                             shm_prefix=self.shm_prefix)

    def _resume(self) -> TrainState:
        ckpt = load_latest_checkpoint(self.run, self.meta, self.cfg.keep_checkpoints,
                                      lambda obj: distributed.gather_objects(obj, self.dist))
        if ckpt is None:
            return TrainState()
        path = ckpt.path
        state, entry_states = ckpt.rank_state(self.dist.rank, self.dist.world_size)
        if state.step > self.cfg.max_steps:  # the loop would not run, and the export would be this later step's
            raise ValueError(f"{path}: this run directory already trained to step {state.step}, past "
                             f"trainer.max_steps={self.cfg.max_steps}; its export would be step {state.step}'s "
                             f"weights, not a {self.cfg.max_steps}-step run's. Use a new hydra.run.dir, or "
                             f"trainer.max_steps >= {state.step} to continue this run")
        for entry in self.entries:
            saved = ckpt.drafters[entry.name]
            entry.validation = ValidationState.from_checkpoint(saved.get("validation"))
            parallel.load_model_state(entry.drafter, saved["drafter"])
            parallel.load_optimizer_state(entry.drafter, entry.optimizers.optimizers, saved["optimizers"])
            own = entry_states[entry.name]
            if "generator" in own:  # not when saved by another number of ranks: the RNG starts fresh
                entry.generator.set_state(own["generator"])
            entry.load_state(own)
        log.info("resumed from %s at step %d (epoch %d, %d rows consumed)", path, state.step, state.epoch,
                 len(state.consumed_row_ids))
        return state

    def _save(self, state: TrainState) -> None:
        # Collectives under fsdp (full tensors are gathered) and for the per-rank entries: every rank takes part.
        drafters = {e.name: {"drafter": parallel.model_state(e.drafter),
                             "optimizers": parallel.optimizer_state(e.drafter, e.optimizers.optimizers),
                             "validation": e.validation.to_checkpoint()} for e in self.entries}
        ranks = distributed.gather_objects(rank_entry(state, {e.name: {**e.state(), "generator": e.generator.get_state()}
                                                              for e in self.entries}), self.dist)
        if self.dist.is_main:
            save_checkpoint(self.run, state.step, ranks, drafters, self.meta, self.cfg.keep_checkpoints)
        distributed.barrier(self.dist)

    def _log(self, state: TrainState) -> None:
        for entry in self.entries:
            window = entry.window.reduced(self.dist)
            loss = distributed.all_reduce_sum(torch.tensor([entry.last_loss], device=self.dist.device), self.dist)
            record = {"loss": float(loss) / self.dist.world_size, **window.summary()}  # all ranks
            entry.window = StepMetrics(entry.drafter.num_speculative_tokens)
            if not entry.active:
                continue
            self.tracker.log({"step": state.step, **self._series(entry, record)})
            if self.dist.is_main:
                log.info("step %d %sloss %.4f acc@1 %.3f tau_est %.3f", state.step, self._prefix(entry, " "),
                         record["loss"], record["accuracy_per_position"][0], record["tau_estimate"])

    def _prefix(self, entry: Entry, sep: str = "/") -> str:
        """Several drafters: their logs and wandb series carry their names; one drafter keeps the plain keys."""
        return f"{entry.name}{sep}" if self.several else ""

    def _series(self, entry: Entry, record: dict) -> dict:
        return {f"{self._prefix(entry)}{k}": v for k, v in record.items()}

    # --- validation --------------------------------------------------------------------------------
    def _eval_rows(self) -> tuple[list, list]:
        """Rank 0's held-out rows and trainer.probe_rows training rows (the probe; default as many as held-out, with
        ids moved past any file's line count so one stream can carry both), extracted once by the feed before the
        first epoch."""
        if not self.dist.is_main:
            return [], []
        heldout = list(self.heldout_rows[: self.cfg.eval_rows] if self.cfg.eval_rows else self.heldout_rows)
        if not heldout:
            log.warning("no held-out rows: tau_offline and the held-out curve are not measured")
            return [], []
        probe_rows = len(heldout) if self.cfg.probe_rows is None else self.cfg.probe_rows
        return heldout, [replace(r, row_id=PROBE_ROW_OFFSET + r.row_id) for r in self.rows[:probe_rows]]

    def _make_validators(self, heldout: list, probe: list) -> None:
        """Rank 0: each drafter's validator over the held-out and probe samples (kept for every evaluation), as that
        drafter trains on them (its feature ablation applied; without one the samples are shared)."""
        if not heldout:
            return
        samples = sorted(self.feed.eval_samples(), key=lambda s: s.row_id)
        for entry in self.entries:
            held, probed = [], []
            ablation_rng = torch.Generator().manual_seed(self.cfg.seed)  # evaluated on what it was trained on
            for s in samples:
                if entry.cfg.feature_ablation != "none":  # ablated as the step ablates them: after the fp8 scales
                    s = s.dequantised()
                hidden = ablate_hidden(s.hidden_TLD, self.spec.context_layer_ids, entry.cfg.feature_ablation,
                                       entry.input_layer_ids, ablation_rng)
                if s.row_id >= PROBE_ROW_OFFSET:
                    probed.append(replace(s, row_id=s.row_id - PROBE_ROW_OFFSET, hidden_TLD=hidden))
                else:
                    held.append(replace(s, hidden_TLD=hidden))
            entry.validator = Validator(held, probed, self.spec, self.dist.device, entry.validation,
                                        self.heldout_stages, static=entry.static)

    def _validate(self, entry: Entry, state: TrainState) -> None:
        drafter = self._unsharded_drafter(entry)  # a collective under fsdp: every rank calls it
        if not self.dist.is_main or entry.validator is None:
            return
        # A stopped drafter's weights are of the step before it stopped, whenever they are walked.
        step, tokens = ((entry.stopped["step"] - 1, entry.stopped.get("train_tokens", state.train_tokens))
                        if entry.stopped else (state.step, state.train_tokens))
        point = entry.validator.run(drafter, self.head, step, tokens, entry.train_seconds,
                                    entry.since_validation.tau_estimate)
        entry.since_validation = StepMetrics(entry.drafter.num_speculative_tokens)
        log.info("step %d %sheld-out tau %.3f (a_1 %.3f), on training rows %s, best %.3f at step %d", step,
                 self._prefix(entry, " "), point["heldout_tau"], point["heldout_per_position"][0],
                 "n/a" if point["train_rows_tau"] is None else f"{point['train_rows_tau']:.3f}",
                 entry.validation.best_tau, entry.validation.best_step)
        # wandb's steps only go forward: logged at the run's step, the point says its drafter's
        self.tracker.log({"step": state.step, **self._series(entry, {f"heldout/{k}": v for k, v in point.items()})})

    def _curve_ends_before(self, entry: Entry, step: int) -> bool:
        curve = entry.validation.curve
        last = entry.stopped["step"] - 1 if entry.stopped else step  # a stopped drafter's weights are of that step
        return entry.validator is not None and (not curve or curve[-1]["step"] < last)

    @staticmethod
    def _last_heldout_tau(entry: Entry) -> str:
        curve = entry.validation.curve
        return f"{curve[-1]['heldout_tau']:.2f}" if curve else "-"

    def _export_drafter(self, entry: Entry, drafter):
        """The drafter whose weights are exported: the best held-out ones (trainer.export=best) or the last."""
        best = entry.validation.best_weights
        if self.cfg.export != "best" or best is None:
            return drafter, {"policy": self.cfg.export, "step": None, "heldout_tau": None}
        chosen = self._new_drafter(entry.spec.drafter)
        chosen.load_state_dict(best)
        return chosen, {"policy": "best", "step": entry.validation.best_step, "heldout_tau": entry.validation.best_tau}

    def _finish(self, state: TrainState) -> dict:
        state = self._summed_over_ranks(state)
        drafters = [self._unsharded_drafter(e) for e in self.entries]  # collectives under fsdp: every rank
        losses = distributed.all_reduce_sum(torch.tensor([e.last_loss for e in self.entries], dtype=torch.float64,
                                                         device=self.dist.device), self.dist) / self.dist.world_size
        if not self.dist.is_main:
            return {}
        eval_started = time.perf_counter()
        per_drafter = {}
        for entry, drafter in zip(self.entries, drafters):
            export_dir = self.run.export / entry.name if self.several else self.run.export
            drafter, selected = self._export_drafter(entry, drafter)
            if selected["step"] is None:  # export=last (or no curve): the final weights
                selected["step"] = entry.steps
            drafter.export(export_dir, self.target)
            validator = entry.validator
            report = validator.report(drafter, self.head) if validator else None
            selection_tau = validator.on_selection_rows(drafter, self.head).tau if validator else None
            per_drafter[entry.name] = entry_metrics(entry, report, selection_tau,
                                                    validator.split if validator else None, selected, export_dir,
                                                    final_loss=float(losses[len(per_drafter)]))
        baselines_by_K = self._baselines() or {}
        for entry in self.entries:  # each drafter beside baselines that draft as many tokens as it does
            per_drafter[entry.name]["baselines"] = baselines_by_K.get(entry.drafter.num_speculative_tokens)
        # The run's: at the largest K (the strongest baselines; a drafter above them is above its own K's)
        baselines = baselines_by_K[max(baselines_by_K)] if baselines_by_K else None
        run = run_metrics(state, target=self.target, pack_tokens=self.pack_tokens,
                          wait_fraction=_wait_fraction(state, self.dist.world_size),
                          first_step_seconds=self.first_step_seconds, engine_loads=self.engine_loads_per_worker,
                          eval_seconds=time.perf_counter() - eval_started, train_skips=self.train_skips,
                          heldout_skips=self.heldout_skips, pad_packs=self.pad_packs,
                          pinned_pool_bytes=self.copier.pool.peak_bytes if self.copier else 0,
                          max_open_packs=self.feed.max_open_packs,
                          positions={"mode": self.server_cfg.positions, **self.spec.positions()})
        if self.several:
            metrics = {**run, "drafters": per_drafter, "baselines": baselines}
        else:  # one drafter: the flat metrics.json of README.md "The main job" (its steps and seconds are the run's)
            (only,) = per_drafter.values()
            drafter_part = {k: v for k, v in only.items() if k not in ("name", "steps", "training_seconds")}
            metrics = {**run, **drafter_part, "baselines": baselines}
        self.run.metrics.write_text(json.dumps(metrics, indent=2) + "\n")
        log.info("train rows skipped: %s", self.train_skips.summary())
        for line in summary_lines(per_drafter, baselines_by_K):
            log.info("%s", line)
        self.tracker.finish(metrics)
        return metrics

    def _baselines(self) -> dict | None:
        """The bigram and n-gram baselines on the rows the drafters' reports walked, judged against the target's own
        greedy tokens, as the drafters are (specdistill/evaluation/acceptance.py target_tokens), for each number of
        draft tokens K a drafter of the run has: {K: {"bigram": ..., "ngram": ...}}."""
        validator = self.entries[0].validator
        if validator is None:
            return None
        walked = [(target_row(s, self.spec, self.head, self.dist.device), s.loss_mask_T.long().tolist())
                  for s in validator.reported]
        return baseline_reports(self.rows, walked, [e.drafter.num_speculative_tokens for e in self.entries])

    def _summed_over_ranks(self, state: TrainState) -> TrainState:
        """Counters as the whole job's (every rank trains its own shard); the loss as the mean over ranks."""
        if not self.dist.enabled:
            return state
        values = [float(getattr(state, name)) for name in SUMMED_OVER_RANKS] + [state.last_loss]
        total = distributed.all_reduce_sum(torch.tensor(values, dtype=torch.float64, device=self.dist.device),
                                           self.dist).tolist()
        summed = {name: type(getattr(state, name))(v) for name, v in zip(SUMMED_OVER_RANKS, total)}
        return replace(state, **summed, last_loss=total[-1] / self.dist.world_size)

    def _unsharded_drafter(self, entry: Entry):
        """The drafter with whole weights, for export and evaluation on rank 0 (a collective under fsdp)."""
        if not (self.dist.enabled and self.cfg.parallel == "fsdp"):
            return entry.drafter
        full = parallel.model_state(entry.drafter)
        if not self.dist.is_main:
            return None
        drafter = self._new_drafter(entry.spec.drafter)
        drafter.load_state_dict(full)
        return drafter

    def _new_drafter(self, drafter_cfg):
        """A freshly initialised drafter (or one started from drafter.init_from), prepared on the training rows
        (EAGLE-3 picks its draft vocab, unless the export brings its own), on the device."""
        return self._prepared(build_drafter(drafter_cfg, self.target, self._tokenizer), drafter_cfg)

    def _prepared(self, drafter, drafter_cfg):
        drafter.compute = self.cfg.compute
        drafter.prepare(self.rows)
        if getattr(drafter_cfg, "init_from", None):  # warm start: the export's weights (drafters/warm_start.py)
            drafter.load_export(Path(drafter_cfg.init_from))
        return drafter.to(self.dist.device)


def _wait_fraction(state: TrainState, world_size: int) -> float:
    """Share of the training loop's time a rank spent waiting for features (the wait is summed over ranks, the
    training time is wall-clock)."""
    wait = state.feature_wait_seconds / world_size
    return wait / max(1e-9, state.train_seconds + wait)


def _check_feature_capacity(server_cfg: FeatureServerConfig, workers: int, pack_tokens: int, spec,
                            hidden_size: int) -> None:
    """A worker writes a row's states into its ring and the feed copies them into the row's pack as soon as they
    arrive (specdistill/trainer/feed.py), so a ring must hold the longest row (a pack's worth of tokens) while the previous one
    is being copied out: 2 packs. Less makes the workers write one-off segments or wait on the trainer."""
    pack = pack_tokens * len(spec.layer_ids) * spec.bytes_per_state(hidden_size)
    ring = server_cfg.capacity_mb * 2**20 / workers
    if ring < 2 * pack:
        need = -(-2 * pack * workers // 2**20)
        raise ValueError(f"feature_server.capacity_mb={server_cfg.capacity_mb} gives each of this rank's {workers} "
                         f"workers a {ring / 2**20:.0f} MiB ring, but a {pack_tokens}-token pack of "
                         f"{len(spec.layer_ids)} layers x {hidden_size} {spec.hidden_dtype} is {pack / 2**20:.0f} MiB "
                         f"and a ring must hold 2; set feature_server.capacity_mb >= {need}")


# Compiled flex attention's shapes per run (trainer.pad_packs): training and held-out walks, anchor buckets, block
# sizes; torch's default recompile limit (8) is below what a run plans, and past it the run stops (kernels/attention/
# flex.py RecompileLimitHit) rather than run flex attention uncompiled.
COMPILED_SHAPES_LIMIT = 64


def _pad_packs(pad_packs: bool | None, device: torch.device, drafters: int) -> bool:
    """Whether packs and attention are padded to the run's fixed shapes (core/shapes.py): on CUDA, or when
    trainer.pad_packs=true; on CPU otherwise they are only recorded. The drafters share each compiled attention
    function, so its limits (recompile_limit, and accumulated_recompile_limit, torch's cap over all of a function's
    graphs, 256) become COMPILED_SHAPES_LIMIT per drafter."""
    pad = device.type == "cuda" if pad_packs is None else bool(pad_packs)
    if not pad and device.type == "cuda":
        log.warning("trainer.pad_packs=false on CUDA: every pack length and anchor count compiles flex attention "
                    "anew, and past torch's recompile limit the run stops with an error (metrics.json "
                    "compiled_shapes and compiled_graphs count them; docs/scaling.md, \"Compiled shapes\")")
    if pad and device.type == "cuda":
        import torch._dynamo

        limit = COMPILED_SHAPES_LIMIT * drafters
        config = torch._dynamo.config
        config.recompile_limit = max(config.recompile_limit, limit)
        config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, limit)
    return pad


def _autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """bf16 autocast over fp32 master weights where the device runs it fast (CUDA); fp32 elsewhere."""
    if precision == "fp32" or (precision == "auto" and device.type != "cuda"):
        return None
    if precision in ("bf16", "auto"):
        return torch.bfloat16
    raise ValueError(f"trainer.precision={precision!r}; valid: auto, fp32, bf16")
