"""Online pipeline benchmark (not a test): `python bench/online.py [--target small-real] [--steps 40]`.

Trains the same drafter steps twice in this process, on the same rows in the same order:
  online  `Trainer.train()` as `specdistill-train` runs it: one feature server for the run (HF backend, its
          own worker processes) streams epoch after epoch through shared memory, and the feed thread packs
          `trainer.prefetch_steps` steps ahead of the training step (specdistill/trainer/feed.py)
  cached  the same packs extracted beforehand and held in memory: the training step alone
The drafter is DFlash with 2 layers on small-real, whose step (~2 s on 2 cores) is slower than the prefill of its
pack (~0.5 s): feature capacity >= demand, the case where the trainer must never wait. Rows are few enough that
the run spans several epochs, so the engine-load count covers epoch boundaries.
On CPU the trainer and the worker share the cores (specdistill/trainer/layout.py cpu_threads, OpenMP's passive wait), and the
cached run uses as many trainer threads, so the ratio measures the pipeline.
Last lines:
  trainer_wait_fraction: F    online, time the training loop waited for features / (that + its step time)
  online_vs_cached: R         training tokens/s online / tokens/s cached (1.0 = extraction fully hidden)
  first_step_seconds: S       online, from this process's launch to the end of the first optimizer step
  engine_loads_per_worker: N  target (engine) loads per feature worker over the run's epochs (1 = one server)
"""

import argparse
import os
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as specdistill/launch/train.py, before torch loads OpenMP
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from specdistill.core.batch import pack_stream  # noqa: E402
from specdistill.drafters import DRAFTERS  # noqa: E402
from specdistill.feature_server.config import FeatureServerConfig  # noqa: E402
from specdistill.launch.config import DataConfig, TargetConfig  # noqa: E402
from specdistill.launch.prepare import resolve_data, resolve_target  # noqa: E402
from specdistill.trainer.checkpoint import TrainState  # noqa: E402
from specdistill.trainer.config import TrainerConfig  # noqa: E402
from specdistill.trainer.trainer import Trainer  # noqa: E402


def build_trainer(args, run_dir: Path) -> Trainer:
    cache = Path(args.cache_dir)
    target_dir = resolve_target(TargetConfig(name=args.target), cache)
    data = DataConfig(source=args.data, rows=args.rows, heldout_rows=4, prompt_tokens=320, prompt_min_tokens=96,
                      max_new_tokens=64)
    train, heldout = resolve_data(data, target_dir, cache)
    drafter_cfg = DRAFTERS[args.drafter][0](num_layers=args.drafter_layers)
    trainer_cfg = TrainerConfig(max_steps=args.steps, ranks=1, device="cpu", progress=False, eval_every=0,
                                eval_rows=4, log_every=10**9, checkpoint_every=10**9, prefetch_steps=args.prefetch)
    server_cfg = FeatureServerConfig(workers=args.workers, threads_per_worker=args.worker_threads)
    return Trainer(drafter_cfg, trainer_cfg, server_cfg, run_dir, target_dir, train, heldout)


def run_cached(trainer: Trainer, steps: int) -> dict:
    """The same steps on packs extracted beforehand: the trainer alone (one-shot server, then only steps)."""
    with trainer._server(trainer.rows) as server:  # one worker: the online run's dataset order
        samples = [replace(s, hidden_TLD=s.hidden_TLD.clone()) for s in sorted(server, key=lambda s: s.row_id)]
    order = {r.row_id: i for i, r in enumerate(trainer.rows)}
    samples.sort(key=lambda s: order[s.row_id])
    epoch = list(pack_stream(samples, trainer.cfg.token_budget, trainer.spec.layer_ids))
    state = TrainState()
    while state.step < steps:  # epoch after epoch, as the online run
        state.consumed_row_ids.clear()  # as the trainer does at an epoch's end
        for batch in epoch[:steps - state.step]:
            trainer._step(batch, state)
    return {"seconds": state.train_seconds, "tokens": state.train_tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="small-real")
    parser.add_argument("--data", default="corpus")
    parser.add_argument("--drafter", default="dflash")
    parser.add_argument("--drafter-layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rows", type=int, default=120)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--worker-threads", type=int, default=1)
    parser.add_argument("--prefetch", type=int, default=TrainerConfig.prefetch_steps)
    parser.add_argument("--cache-dir", default=".cache/specdistill")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        trainer = build_trainer(args, Path(tmp))
        initial = {k: v.clone() for k, v in trainer.drafter.state_dict().items()}
        online = trainer.train()
        trainer.drafter.load_state_dict(initial)  # the same starting point for the cached run
        trainer.optimizers = type(trainer.optimizers)(trainer.drafter, trainer.cfg)
        trainer.generator.manual_seed(trainer.cfg.seed)
        cached = run_cached(trainer, online["steps"])
    wall_online = online["training_seconds"] + online["feature_wait_seconds"]
    rate_online, rate_cached = online["train_tokens"] / wall_online, cached["tokens"] / cached["seconds"]
    print(f"{args.drafter} {args.drafter_layers} layers on {args.target}, {len(trainer.rows)} rows, {online['steps']} "
          f"steps over {online['epochs_completed']} epochs, {torch.get_num_threads()} trainer threads, "
          f"{args.workers} worker(s) x {args.worker_threads} thread(s), prefetch {args.prefetch} steps")
    print(f"online: {online['train_tokens']} tokens, steps {online['training_seconds']:.1f} s + waiting "
          f"{online['feature_wait_seconds']:.2f} s; worker-side extraction {online['feature_extraction_seconds']:.1f} s")
    print(f"cached: {cached['tokens']} tokens in {cached['seconds']:.1f} s")
    # On CPU the worker's prefill takes cores the step would use: online can at best reach the cached step's
    # core-seconds over those plus the extraction's. On separate devices (GPU workers) the bound is 1 - wait.
    step_core_s = cached["seconds"] * torch.get_num_threads()
    extract_core_s = online["feature_extraction_seconds"] * args.worker_threads
    print(f"shared-core bound on online_vs_cached: {step_core_s / (step_core_s + extract_core_s):.3f} "
          f"({step_core_s:.0f} core-s of steps, {extract_core_s:.0f} core-s of extraction)")
    print(f"trainer_wait_fraction: {online['feature_wait_fraction']:.3f}")
    print(f"online_vs_cached: {rate_online / rate_cached:.3f}")
    print(f"first_step_seconds: {online['first_step_seconds']:.1f}")
    print(f"engine_loads_per_worker: {online['engine_loads_per_worker']:.2f}")


if __name__ == "__main__":
    main()
