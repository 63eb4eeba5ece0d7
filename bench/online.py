"""Online pipeline benchmark (not a test): `python bench/online.py [--target tiny-qwen3-next] [--steps 20]`.

Trains the same drafter steps twice in this process, on the same rows in the same order:
  online  features stream from a feature worker (HF backend, its own process) through shared memory while the
          trainer steps, as `python -m launch.train` runs
  cached  the same samples extracted beforehand and held in memory: the trainer alone
Reports the trainer's wall time split, and last:
  trainer_wait_fraction: F   online, time the trainer waited for features / its wall time, from the first
                             sample on (the worker's one-off model load is reported separately)
  online_vs_cached: R        samples/s online / samples/s cached (1.0 = feature extraction fully hidden)
On 2 CPU cores the worker and the trainer share the machine; `--trainer-threads` and `--worker-threads` split it.
"""

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from core.batch import pack_stream  # noqa: E402
from core.contract import FeatureSample  # noqa: E402
from drafters import DRAFTERS  # noqa: E402
from feature_server.config import FeatureServerConfig  # noqa: E402
from launch.config import DataConfig, TargetConfig  # noqa: E402
from launch.prepare import resolve_data, resolve_target  # noqa: E402
from trainer.checkpoint import TrainState  # noqa: E402
from trainer.config import TrainerConfig  # noqa: E402
from trainer.trainer import Trainer  # noqa: E402


def build_trainer(args, run_dir: Path) -> Trainer:
    cache = Path(args.cache_dir)
    target_dir = resolve_target(TargetConfig(name=args.target), cache)
    train, heldout = resolve_data(DataConfig(rows=args.rows, heldout_rows=2), target_dir, cache)
    drafter_cfg = DRAFTERS[args.drafter][0](num_layers=args.drafter_layers, max_anchors=args.max_anchors)
    trainer_cfg = TrainerConfig(max_steps=args.steps, ranks=1, device="cpu", token_budget=args.token_budget,
                                progress=False, eval_rows=0, log_every=10**9, checkpoint_every=10**9)
    server_cfg = FeatureServerConfig(workers=1, threads_per_worker=args.worker_threads)
    return Trainer(drafter_cfg, trainer_cfg, server_cfg, run_dir, target_dir, train, heldout)


def run_online(trainer: Trainer, steps: int) -> dict:
    state, waited, samples = TrainState(), 0.0, 0
    started = time.perf_counter()
    with trainer._server(trainer.rows) as server:
        t_wait = time.perf_counter()
        first = None
        for batch in pack_stream(server, trainer.cfg.token_budget, trainer.spec.layer_ids):
            now = time.perf_counter()
            if first is None:
                first = now  # the worker's model load and first prefill are behind us
            else:
                waited += now - t_wait
            trainer._step(batch, state)
            samples += len(batch.row_ids)
            if state.step >= steps:
                break
            t_wait = time.perf_counter()
        end = time.perf_counter()
    return {"wall_s": end - first, "startup_s": first - started, "wait_s": waited, "samples": samples,
            "steps": state.step}


def collect(trainer: Trainer) -> list[FeatureSample]:
    with trainer._server(trainer.rows) as server:  # cloned: holding views would pin the worker's ring
        return [FeatureSample(s.row_id, s.input_ids_T.clone(), s.loss_mask_T.clone(), s.hidden_TLD.clone())
                for s in server]


def run_cached(trainer: Trainer, samples: list[FeatureSample], steps: int) -> dict:
    state, consumed = TrainState(), 0
    packs = list(pack_stream(samples, trainer.cfg.token_budget, trainer.spec.layer_ids))[:steps]
    started = time.perf_counter()
    for batch in packs:
        trainer._step(batch, state)
        consumed += len(batch.row_ids)
    return {"wall_s": time.perf_counter() - started, "samples": consumed, "steps": state.step}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="tiny-qwen3-next")
    parser.add_argument("--drafter", default="dflash")
    parser.add_argument("--drafter-layers", type=int, default=2)
    parser.add_argument("--max-anchors", type=int, default=256)
    parser.add_argument("--token-budget", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--rows", type=int, default=96)
    parser.add_argument("--trainer-threads", type=int, default=1)
    parser.add_argument("--worker-threads", type=int, default=1)
    parser.add_argument("--cache-dir", default=".cache/specdistill")
    args = parser.parse_args()
    torch.set_num_threads(args.trainer_threads)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = build_trainer(args, Path(tmp))
        initial = {k: v.clone() for k, v in trainer.drafter.state_dict().items()}
        cached_samples = collect(trainer)
        online = run_online(trainer, args.steps)
        trainer.drafter.load_state_dict(initial)  # the same starting point for the second run
        trainer.optimizers = type(trainer.optimizers)(trainer.drafter, trainer.cfg)
        cached = run_cached(trainer, cached_samples, online["steps"])
    rate_online = online["samples"] / online["wall_s"]
    rate_cached = cached["samples"] / cached["wall_s"]
    print(f"rows {len(cached_samples)}, steps {online['steps']}, {args.drafter} {args.drafter_layers} layers, "
          f"{args.token_budget}-token packs, target {args.target}")
    print(f"online: {online['samples']} samples in {online['wall_s']:.1f} s ({rate_online:.2f}/s), waited "
          f"{online['wait_s']:.2f} s; worker start-up {online['startup_s']:.1f} s (once per run)")
    print(f"cached: {cached['samples']} samples in {cached['wall_s']:.1f} s ({rate_cached:.2f}/s)")
    print(f"trainer_wait_fraction: {online['wait_s'] / online['wall_s']:.3f}")
    print(f"online_vs_cached: {rate_online / rate_cached:.3f}")


if __name__ == "__main__":
    main()
