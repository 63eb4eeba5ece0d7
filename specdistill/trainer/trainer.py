"""The training loop: features stream in from the target workers, packs go through the drafter.

Read `train()` top to bottom: resume -> the feature feed (one feature server for the run, packing ahead of the
step: specdistill/trainer/feed.py) -> steps, epoch after epoch -> export -> offline evaluation -> metrics.json. `_step()` is
the whole training step.
"""

import hashlib
import json
import logging
import os
import time
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import psutil
import torch
from tqdm import tqdm
from transformers import AutoTokenizer

from specdistill.core.batch import PackedBatch
from specdistill.core.rows import as_rows
from specdistill.core.run_dir import RunDir
from specdistill.core.shapes import StaticShapes
from specdistill.core.target import TargetHead, TargetInfo
from specdistill.data.config import DataConfig
from specdistill.data.formats import check_tokenizer_matches
from specdistill.data.selection import check_skipped, load_selected
from specdistill.drafters import build_drafter
from specdistill.feature_server.config import FeatureServerConfig
from specdistill.feature_server.ledger import shard_rows
from specdistill.feature_server.server import FeatureServer
from specdistill.trainer.layout import cpu_threads, cuda_device_count, plan_node
from specdistill.trainer import distributed, parallel
from specdistill.trainer.ablation import ablate, ablate_hidden, check_ablation
from specdistill.trainer.checkpoint import SUMMED_OVER_RANKS, TrainState, load_checkpoint, rank_entry, save_checkpoint
from specdistill.trainer.config import TrainerConfig
from specdistill.trainer.device_copy import DeviceCopier, on_device
from specdistill.trainer.feed import EpochEnd, FeatureFeed
from specdistill.trainer.metrics import StepMetrics
from specdistill.trainer.optim import Optimizers
from specdistill.trainer.tracking import Tracker
from specdistill.trainer.validation import ValidationState, Validator, check_eval_settings, resolve_eval_every, usable_heldout

# Probe rows (training rows walked beside the held-out ones) get ids past any file's line count, so one feature
# server can extract both sets without their row ids colliding in its exactly-once ledger.
PROBE_ROW_OFFSET = 1 << 40

log = logging.getLogger(__name__)


class Trainer:
    def __init__(self, drafter_cfg, trainer_cfg: TrainerConfig, server_cfg: FeatureServerConfig, run_dir: Path,
                 target_dir: Path, train_path: Path, heldout_path: Path | None, resolved_config: dict | None = None,
                 data_cfg: DataConfig | None = None, cache_dir: Path | None = None):
        self.launched = psutil.Process().create_time()  # first_step_seconds: this process's launch to its first step
        self.first_step_seconds: float | None = None
        self.cfg, self.server_cfg, self.run = trainer_cfg, server_cfg, RunDir(run_dir)
        self.layout = plan_node(trainer_cfg.ranks, server_cfg.workers, trainer_cfg.device, server_cfg.device,
                                cuda_device_count())
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
        self.dist = distributed.init_distributed(trainer_cfg.device, trainer_cfg.collective_timeout_s)
        threads = cpu_threads(trainer_cfg.threads, self.dist.device.type, trainer_cfg.ranks)
        if threads is not None:
            torch.set_num_threads(threads)
            log.info("trainer rank %d: %d CPU threads (trainer.threads)", self.dist.rank, threads)
        torch.manual_seed(trainer_cfg.seed)
        self.target = TargetInfo.load(target_dir)
        tokenizer = AutoTokenizer.from_pretrained(str(target_dir), local_files_only=True)
        check_tokenizer_matches(tokenizer, {"vocab_size": self.target.vocab_size})
        self._load_data(target_dir, train_path, heldout_path, data_cfg or DataConfig(),
                        Path(cache_dir or os.environ.get("SPECDISTILL_CACHE", ".cache/specdistill")))
        self._drafter_cfg, self._tokenizer = drafter_cfg, tokenizer  # _new_drafter rebuilds it after fsdp
        self.drafter = self._new_drafter()
        self.head = TargetHead(self.target).to(self.dist.device)
        self.spec = replace(self.drafter.feature_spec(), hidden_dtype=server_cfg.hidden_dtype)
        self.spec.check_against(self.target.num_hidden_layers)
        self.input_layer_ids = self.drafter.input_layer_ids()
        check_ablation(trainer_cfg.feature_ablation, self.input_layer_ids, self.target.num_hidden_layers)
        _check_feature_capacity(server_cfg, self.layout.workers_per_rank, self.pack_tokens, self.spec,
                                self.target.hidden_size)
        self.model = parallel.wrap(self.drafter, trainer_cfg.parallel, self.dist)
        if trainer_cfg.compile:
            self.model = torch.compile(self.model)
        self.optimizers = Optimizers(self.drafter, trainer_cfg)
        self.generator = torch.Generator().manual_seed(trainer_cfg.seed + self.dist.rank)
        self.autocast_dtype = _autocast_dtype(trainer_cfg.precision, self.dist.device)
        self.static = _static_shapes(trainer_cfg.pad_packs, self.pack_tokens, self.dist.device)
        # CUDA: packs assembled in pinned memory and copied ahead of the step on a side stream (device_copy.py)
        self.copier = DeviceCopier(self.dist.device) if self.dist.device.type == "cuda" else None
        self.meta = {"drafter": drafter_cfg.name, "target_layer_ids": list(self.spec.layer_ids),
                     "model_type": self.target.model_type}
        self.window = StepMetrics(self.drafter.num_speculative_tokens)
        self.totals = StepMetrics(self.drafter.num_speculative_tokens)
        self.since_validation = StepMetrics(self.drafter.num_speculative_tokens)  # the train side of each point
        # Stable per run and rank, so a crashed run's leftover segments are swept when it resumes.
        run_key = hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:10]
        self.shm_prefix = f"specdistill_{run_key}_r{self.dist.rank}"
        self.tracker = Tracker.from_run_config(resolved_config or {}, run_dir, enabled=self.dist.is_main)

    def _load_data(self, target_dir: Path, train_path: Path, heldout_path: Path | None, data_cfg: DataConfig,
                   cache_dir: Path) -> None:
        """The training and held-out rows from their token stores (tokenized once per node, memory-mapped), cut or
        skipped to fit a pack (specdistill/data/selection.py); stops here when too many rows would be skipped."""
        # A pack holds trainer.token_budget tokens of rows laid end to end (positions restart per row); a row must
        # fit a pack and the target's context, since the target prefills it whole.
        self.pack_tokens = self.cfg.token_budget
        self.row_tokens = min(self.target.max_position_embeddings, self.cfg.token_budget)
        progress = self.cfg.progress and self.dist.is_main
        self.rows, self.train_skips, store = load_selected(train_path, target_dir, cache_dir, self.row_tokens,
                                                           data_cfg, progress)
        check_skipped(store, self.train_skips, data_cfg.max_skipped_fraction, self.row_tokens, data_cfg.truncate,
                      self.target.max_position_embeddings)
        if not len(self.rows):
            raise ValueError(f"{train_path}: no trainable rows ({self.train_skips.summary()})")
        log.info("train rows: %s", self.train_skips.summary())
        self.heldout_rows, self.heldout_skips, self.heldout_stages = as_rows([]), None, {}
        if heldout_path:
            held, self.heldout_skips, held_store = load_selected(heldout_path, target_dir, cache_dir,
                                                                 self.row_tokens, data_cfg, progress)
            if not len(held):
                raise ValueError(f"{heldout_path}: no usable held-out row ({self.heldout_skips.summary()}); held-out "
                                 "rows need response tokens (loss_mask 1) and must fit trainer.token_budget")
            self.heldout_rows = usable_heldout(held, heldout_path)  # an index into the store, like the training rows
            self.heldout_stages = held_store.stages_by_row_id()
        self.heldout_path = heldout_path

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
            self.validator = self._make_validator(heldout, probe)
            bar = tqdm(total=self.cfg.max_steps, initial=state.step,
                       disable=not (self.cfg.progress and self.dist.is_main), desc=f"train {self.meta['drafter']}",
                       unit="step")
            if self.eval_every and not self.validation.curve:
                self._validate(state)  # step 0: the untrained (or, for MTP, the target's own) drafter, the origin
            self._loop(state, bar)
            bar.close()
        finally:
            self._close_feed(state)  # on errors too: its workers stop, its counts are kept
        if self._curve_ends_before(state.step):
            self._validate(state)  # the final weights are candidates for the export too
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
            train_tau = self.window.tau_estimate  # before _log starts a new window
            if state.step % self.cfg.log_every == 0:
                self._log(state)
            if self.eval_every and state.step % self.eval_every == 0:
                self._validate(state)
            bar.set_postfix(loss=f"{state.last_loss:.3f}", tau=f"{train_tau:.2f}", heldout_tau=self._last_heldout_tau())
            if state.step % self.cfg.checkpoint_every == 0:
                self._save(state)

    def _make_feed(self, state: TrainState, eval_rows: list) -> FeatureFeed:
        """The run's feature feed, from where a resumed run stopped (its epoch, minus the rows trained on)."""
        return FeatureFeed(self._run_server, self.rows, token_budget=self.pack_tokens,
                           layer_ids=self.spec.layer_ids, grad_accum=self.cfg.grad_accum,
                           prefetch=self.cfg.prefetch_steps, max_epochs=self.cfg.max_epochs, start_epoch=state.epoch,
                           skip_row_ids=frozenset(state.consumed_row_ids), eval_rows=eval_rows,
                           pad_to=self.pack_tokens if self.static.pad else None, copier=self.copier).start()

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
        """One optimizer step over `trainer.grad_accum` packs (micro-batches; host packs, or packs already being
        copied to the device: trainer/device_copy.py): the mean of their losses, so 1 rank x N packs and N ranks x
        1 pack (DDP averages) take the same step."""
        started = time.perf_counter()
        micro = [micro] if isinstance(micro, PackedBatch) else micro
        self.optimizers.set_step(state.step)
        losses = []
        for i, item in enumerate(micro):
            batch = replace(on_device(item, self.dist.device, torch.float32), static=self.static)
            batch = ablate(batch, self.cfg.feature_ablation, self.input_layer_ids, self.generator)
            last = i == len(micro) - 1
            # Gradients are reduced over the ranks once, on the last micro-batch.
            with parallel.gradient_sync(self.model, self.cfg.parallel, self.dist, sync=last):
                with torch.autocast(self.dist.device.type, dtype=self.autocast_dtype or torch.float32,
                                    enabled=self.autocast_dtype is not None):
                    out = self.model(batch, self.head, self.generator)
                if not torch.isfinite(out.loss):
                    self._stop_on_non_finite(batch, state, out.loss)
                (out.loss / len(micro)).backward()
            losses.append(float(out.loss.detach()))
            self._count_batch(batch, state)
            self.window.add(out)
            self.totals.add(out)
            self.since_validation.add(out)
        self.optimizers.clip_step_and_zero(self.drafter.parameters(), self.cfg.grad_clip)
        state.step += 1
        state.last_loss = sum(losses) / len(losses)
        state.train_seconds += time.perf_counter() - started

    def _count_batch(self, batch: PackedBatch, state: TrainState) -> None:
        state.train_tokens += batch.num_real_tokens  # padding is not counted (core/batch.py)
        state.packs += 1
        state.train_response_tokens += int(batch.loss_mask_T.sum())
        seen_twice = state.consumed_row_ids.intersection(batch.row_ids)
        if seen_twice or len(set(batch.row_ids)) != len(batch.row_ids):
            log.error("step %d: rows %s reached the trainer twice this epoch", state.step + 1, sorted(seen_twice)[:10])
            state.samples_duplicated += len(seen_twice) + len(batch.row_ids) - len(set(batch.row_ids))
        state.consumed_row_ids.update(batch.row_ids)

    def _stop_on_non_finite(self, batch: PackedBatch, state: TrainState, loss: torch.Tensor) -> None:
        """Stop before the poisoned update reaches the weights or a checkpoint; name the step and the rows."""
        finite_T = torch.isfinite(batch.hidden_TLD).flatten(1).all(-1)
        bad_docs = batch.document_ids_T[~finite_T].unique().tolist()
        bad_rows = [batch.row_ids[d] for d in bad_docs if d < len(batch.row_ids)]  # not the padding document
        where = (f"non-finite target hidden states in rows {bad_rows}" if bad_rows else
                 "the target's hidden states are finite, so the drafter diverged (lower trainer.lr / muon_lr?)")
        raise FloatingPointError(f"step {state.step + 1}: loss is {float(loss.detach())} on rows {list(batch.row_ids)}; {where}. "
                                 f"Nothing was written for this step; the last checkpoint is step "
                                 f"{state.step // self.cfg.checkpoint_every * self.cfg.checkpoint_every}")

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
        path = self.run.latest_checkpoint()
        self.validation = ValidationState()
        if path is None:
            return TrainState()
        ckpt = load_checkpoint(path, self.meta)
        self.validation = ValidationState.from_checkpoint(ckpt.validation)
        parallel.load_model_state(self.drafter, ckpt.drafter)
        parallel.load_optimizer_state(self.drafter, self.optimizers.optimizers, ckpt.optimizers)
        state, generator_state = ckpt.rank_state(self.dist.rank, self.dist.world_size)
        if state.step > self.cfg.max_steps:  # the loop would not run, and the export would be this later step's
            raise ValueError(f"{path}: this run directory already trained to step {state.step}, past "
                             f"trainer.max_steps={self.cfg.max_steps}; its export would be step {state.step}'s "
                             f"weights, not a {self.cfg.max_steps}-step run's. Use a new hydra.run.dir, or "
                             f"trainer.max_steps >= {state.step} to continue this run")
        if generator_state is not None:
            self.generator.set_state(generator_state)
        log.info("resumed from %s at step %d (epoch %d, %d rows consumed)", path, state.step, state.epoch,
                 len(state.consumed_row_ids))
        return state

    def _save(self, state: TrainState) -> None:
        # Collectives under fsdp (full tensors are gathered) and for the per-rank entries: every rank takes part.
        drafter_state = parallel.model_state(self.drafter)
        optimizer_state = parallel.optimizer_state(self.drafter, self.optimizers.optimizers)
        ranks = distributed.gather_objects(rank_entry(state, self.generator), self.dist)
        if self.dist.is_main:
            save_checkpoint(self.run, state.step, ranks, drafter_state, optimizer_state, self.meta,
                            self.cfg.keep_checkpoints, self.validation.to_checkpoint())
        distributed.barrier(self.dist)

    def _log(self, state: TrainState) -> None:
        window = self.window.reduced(self.dist)
        loss = distributed.all_reduce_sum(torch.tensor([state.last_loss], device=self.dist.device), self.dist)
        record = {"step": state.step, "loss": float(loss) / self.dist.world_size, **window.summary()}  # all ranks
        self.tracker.log(record)
        if self.dist.is_main:
            log.info("step %d loss %.4f acc@1 %.3f tau_est %.3f", state.step, state.last_loss,
                     record["accuracy_per_position"][0], record["tau_estimate"])
        self.window = StepMetrics(self.drafter.num_speculative_tokens)

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

    def _make_validator(self, heldout: list, probe: list) -> Validator | None:
        """Rank 0: the held-out and probe samples (kept for every evaluation), as trained (ablation applied)."""
        if not heldout:
            return None
        held, probed = [], []
        ablation_rng = torch.Generator().manual_seed(self.cfg.seed)  # evaluated on what it was trained on
        for s in sorted(self.feed.eval_samples(), key=lambda s: s.row_id):
            hidden = ablate_hidden(s.hidden_TLD, self.spec.layer_ids, self.cfg.feature_ablation,
                                   self.input_layer_ids, ablation_rng)
            if s.row_id >= PROBE_ROW_OFFSET:
                probed.append(replace(s, row_id=s.row_id - PROBE_ROW_OFFSET, hidden_TLD=hidden))
            else:
                held.append(replace(s, hidden_TLD=hidden))
        return Validator(held, probed, self.spec.layer_ids, self.dist.device, self.validation, self.heldout_stages,
                         static=self.static)

    def _validate(self, state: TrainState) -> None:
        drafter = self._unsharded_drafter()  # a collective under fsdp: every rank calls it
        if not self.dist.is_main or self.validator is None:
            return
        point = self.validator.run(drafter, self.head, state.step, state.train_tokens, state.train_seconds,
                                   self.since_validation.tau_estimate)
        self.since_validation = StepMetrics(self.drafter.num_speculative_tokens)
        log.info("step %d held-out tau %.3f (a_1 %.3f), on training rows %s, best %.3f at step %d", state.step,
                 point["heldout_tau"], point["heldout_per_position"][0],
                 "n/a" if point["train_rows_tau"] is None else f"{point['train_rows_tau']:.3f}",
                 self.validation.best_tau, self.validation.best_step)
        self.tracker.log({"step": state.step, **{f"heldout/{k}": v for k, v in point.items() if k != "step"}})

    def _curve_ends_before(self, step: int) -> bool:
        curve = self.validation.curve
        return self.validator is not None and (not curve or curve[-1]["step"] < step)

    def _last_heldout_tau(self) -> str:
        curve = self.validation.curve
        return f"{curve[-1]['heldout_tau']:.2f}" if curve else "-"

    def _export_drafter(self, drafter):
        """The drafter whose weights are exported: the best held-out ones (trainer.export=best) or the last."""
        best = self.validation.best_weights
        if self.cfg.export != "best" or best is None:
            return drafter, {"policy": self.cfg.export, "step": None, "heldout_tau": None}
        chosen = self._new_drafter()
        chosen.load_state_dict(best)
        return chosen, {"policy": "best", "step": self.validation.best_step, "heldout_tau": self.validation.best_tau}

    def _finish(self, state: TrainState) -> dict:
        metrics = {}
        state = self._summed_over_ranks(state)
        drafter = self._unsharded_drafter()
        if self.dist.is_main:
            export_dir = self.run.export
            drafter, selected = self._export_drafter(drafter)
            if selected["step"] is None:  # export=last (or no curve): the final weights
                selected["step"] = state.step
            drafter.export(export_dir, self.target)
            eval_started = time.perf_counter()
            report = self.validator.report(drafter, self.head) if self.validator else None
            counts = report.total if report else None
            curve = self.validation.curve
            metrics = {
                "drafter": self.meta["drafter"],
                "target": str(self.target.path),
                "target_model_type": self.target.model_type,
                "steps": state.step,
                "epochs_completed": state.epoch,
                "train_tokens": state.train_tokens,
                "packs": state.packs,
                "pack_tokens": self.pack_tokens,
                "pack_fill": state.train_tokens / max(1, state.packs * self.pack_tokens),
                # Fixed shapes (core/shapes.py): the shapes compiled attention saw in this process (on CPU, those
                # padding would give), the share of the packs' laid-out tokens and of the anchor query blocks that is
                # padding (on CPU, what padding would add).
                "pad_packs": self.static.pad,
                "compiled_shapes": self.static.count,
                "pad_fraction": 1 - state.train_tokens / max(1, state.packs * self.pack_tokens),
                "anchor_pad_fraction": self.static.query_pad_fraction,
                "pinned_pool_mib": self.copier.pool.bytes / 2**20 if self.copier else 0.0,
                "max_open_packs": self.feed.max_open_packs,
                "train_response_tokens": state.train_response_tokens,
                "final_loss": state.last_loss,
                "train_accuracy_per_position": self.totals.summary()["accuracy_per_position"],
                "tau_offline": counts.tau if counts else None,
                "tau_offline_selection_rows": (self.validator.on_selection_rows(drafter, self.head).tau
                                               if self.validator else None),
                "heldout_split": self.validator.split if self.validator else None,
                "per_position_acceptance": counts.per_position if counts else None,
                "conditional_acceptance": counts.conditional if counts else None,
                "heldout_drafts": counts.num_drafts if counts else 0,
                "heldout_target_disagreement": counts.disagreement_fraction if counts else None,
                "heldout_rows_too_short": counts.rows_too_short if counts else 0,
                "heldout_curve": curve,
                "train_vs_heldout_gap": curve[-1]["gap"] if curve else None,
                "export_selected": selected,
                "acceptance_by_stage": ({s: c.to_dict() for s, c in sorted(report.by_stage.items())}
                                        if report else None),
                "num_speculative_tokens": self.drafter.num_speculative_tokens,
                "feature_extraction_seconds": state.feature_seconds,
                "feature_wait_seconds": state.feature_wait_seconds,
                "feature_wait_fraction": _wait_fraction(state, self.dist.world_size),
                "first_step_seconds": self.first_step_seconds,
                "engine_loads_per_worker": self.engine_loads_per_worker,
                "samples_duplicated": state.samples_duplicated,
                "samples_lost": state.samples_lost,
                "rows_reissued": state.rows_reissued,
                "duplicate_deliveries_dropped": state.duplicate_deliveries_dropped,
                "feature_workers_died": state.feature_workers_died,
                "training_seconds": state.train_seconds,
                "eval_seconds": time.perf_counter() - eval_started,
                "rows_truncated": self.train_skips.truncated,
                "skipped_rows": {"train": asdict(self.train_skips),
                                 "heldout": asdict(self.heldout_skips) if self.heldout_skips else None},
                "export_dir": str(export_dir),
            }
            self.run.metrics.write_text(json.dumps(metrics, indent=2) + "\n")
            log.info("train rows skipped: %s", self.train_skips.summary())
            self.tracker.finish(metrics)
        return metrics

    def _summed_over_ranks(self, state: TrainState) -> TrainState:
        """Counters as the whole job's (every rank trains its own shard); the loss as the mean over ranks."""
        if not self.dist.enabled:
            return state
        values = [float(getattr(state, name)) for name in SUMMED_OVER_RANKS] + [state.last_loss]
        total = distributed.all_reduce_sum(torch.tensor(values, dtype=torch.float64, device=self.dist.device),
                                           self.dist).tolist()
        summed = {name: type(getattr(state, name))(v) for name, v in zip(SUMMED_OVER_RANKS, total)}
        return replace(state, **summed, last_loss=total[-1] / self.dist.world_size)

    def _unsharded_drafter(self):
        """The drafter with whole weights, for export and evaluation on rank 0 (a collective under fsdp)."""
        if not (self.dist.enabled and self.cfg.parallel == "fsdp"):
            return self.drafter
        full = parallel.model_state(self.drafter)
        if not self.dist.is_main:
            return None
        drafter = self._new_drafter()
        drafter.load_state_dict(full)
        return drafter

    def _new_drafter(self):
        """A freshly initialised drafter (or one started from drafter.init_from), prepared on the training rows
        (EAGLE-3 picks its draft vocab, unless the export brings its own), on the device."""
        drafter = build_drafter(self._drafter_cfg, self.target, self._tokenizer)
        drafter.prepare(self.rows)
        if getattr(self._drafter_cfg, "init_from", None):  # warm start: the export's weights (specdistill/drafters/warm_start.py)
            drafter.load_export(Path(self._drafter_cfg.init_from))
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
    pack = pack_tokens * len(spec.layer_ids) * hidden_size * spec.torch_dtype.itemsize
    ring = server_cfg.capacity_mb * 2**20 / workers
    if ring < 2 * pack:
        need = -(-2 * pack * workers // 2**20)
        raise ValueError(f"feature_server.capacity_mb={server_cfg.capacity_mb} gives each of this rank's {workers} "
                         f"workers a {ring / 2**20:.0f} MiB ring, but a {pack_tokens}-token pack of "
                         f"{len(spec.layer_ids)} layers x {hidden_size} {spec.hidden_dtype} is {pack / 2**20:.0f} MiB "
                         f"and a ring must hold 2; set feature_server.capacity_mb >= {need}")


# Compiled flex attention's shapes per run (trainer.pad_packs): training and held-out walks, anchor buckets, block
# sizes; torch's default recompile limit (8) is below what a run plans, and past it the call runs uncompiled.
COMPILED_SHAPES_LIMIT = 64


def _static_shapes(pad_packs: bool | None, pack_tokens: int, device: torch.device) -> StaticShapes:
    """The run's fixed shapes: padded for real on CUDA (or when trainer.pad_packs=true), recorded only on CPU."""
    pad = device.type == "cuda" if pad_packs is None else bool(pad_packs)
    if pad and device.type == "cuda":
        import torch._dynamo

        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, COMPILED_SHAPES_LIMIT)
    return StaticShapes(tokens=pack_tokens, pad=pad)


def _autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """bf16 autocast over fp32 master weights where the device runs it fast (CUDA); fp32 elsewhere."""
    if precision == "fp32" or (precision == "auto" and device.type != "cuda"):
        return None
    if precision in ("bf16", "auto"):
        return torch.bfloat16
    raise ValueError(f"trainer.precision={precision!r}; valid: auto, fp32, bf16")
