"""Muon's share of a DFlash-family training step, timed on CPU (not a test): `python bench/muon_share.py
[--drafter dflash] [--scale 4] [--steps 3] [--two-ranks]`.

The production geometry (bench/production_target.py PRODUCTION and the drafter's production defaults) scaled down by
--scale in every width that sets a FLOP count: hidden size, head width, MLP width, vocabulary, window, and the
mission pack's tokens and response tokens. Every term of the step's count (bench/step_flops.py) and Muon's
Newton-Schulz then shrink by scale^3 alike, so their ratio stays the production one (but for the in-block attention,
scale^2, ~1% of the step; DSpark's Markov and DFlash 2's selector ranks keep their production sizes), and a 2-core
CPU runs a step in seconds. fp32, as the trainer runs on CPU (Muon's iteration in fp32 there).

Prints the median over --steps of forward + loss + backward of the mission pack, of Muon's step and of AdamW's step;
Muon's share of an optimizer step at trainer.grad_accum = 1, 2, 4 (the optimizers run once per step, the pack work
grad_accum times); and the analytic counts at this geometry beside them.

--two-ranks: also times Muon's step alone on 2 gloo ranks of one thread each (the 2 cores), every rank
orthogonalising every matrix (unsplit) against each its share (split, as the trainer runs), for DDP's replicated
matrices and FSDP2's shards; the slower rank's median. Left out: a GPU's bf16 iteration and its links.
"""

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch import nn  # noqa: E402

from bench.production_target import MASK_TOKEN_ID, PRODUCTION, RESPONSE_TOKENS, mission_pack, write_target  # noqa: E402
from bench.step_flops import muon_matrices, optimizer_flops, pack_counts, step_flops  # noqa: E402
from specdistill.core.shapes import StaticShapes  # noqa: E402
from specdistill.core.target import TargetHead  # noqa: E402
from specdistill.drafters import DRAFTERS, drafter_config  # noqa: E402
from specdistill.trainer import distributed, parallel  # noqa: E402
from specdistill.trainer.config import TrainerConfig  # noqa: E402
from specdistill.trainer.device_copy import on_device  # noqa: E402
from specdistill.trainer.distributed import DistContext  # noqa: E402
from specdistill.trainer.optim import GatheredMuon, Optimizers  # noqa: E402

FAMILY = ("dflash", "dspark", "dflash2")
PACK_TOKENS, WINDOW = 32768, 2048
SCALED = ("hidden_size", "head_dim", "vocab_size", "moe_intermediate_size", "shared_expert_intermediate_size")


def build_scaled(name: str, scale: int, target_dir: Path):
    """The target's config and tables, the drafter and the mission pack, every width divided by `scale`."""
    info = write_target(target_dir, {**PRODUCTION, **{k: PRODUCTION[k] // scale for k in SCALED}},
                        torch.device("cpu"))
    cfg = drafter_config(name, {"init_from_target": False, "sliding_window": WINDOW // scale})
    drafter = DRAFTERS[name][1](cfg, info, MASK_TOKEN_ID).train()
    pack = mission_pack(info, drafter.feature_spec().layer_ids, PACK_TOKENS // scale, torch.device("cpu"),
                        response_tokens=round(RESPONSE_TOKENS / scale))
    return info, drafter, pack


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def time_step(drafter, head, pack, steps: int) -> dict:
    """Median seconds of forward + loss + backward and of each optimizer's step (the first step a warm-up)."""
    static = StaticShapes(tokens=pack.input_ids_T.numel(), pad=False)  # as a CPU run lays packs out
    batch = replace(on_device(pack, torch.device("cpu"), torch.float32), static=static)
    optimizers = Optimizers(drafter, TrainerConfig())
    generator = torch.Generator().manual_seed(0)
    state = generator.get_state()
    times: dict[str, list[float]] = {}
    for _ in range(steps + 1):
        times.setdefault("forward_backward", []).append(timed(lambda: drafter(batch, head, generator).loss.backward()))
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        for opt in optimizers.optimizers:
            times.setdefault(type(opt).__name__, []).append(timed(opt.step))
        optimizers.zero_grad()
    counts = pack_counts(drafter, batch, torch.Generator().set_state(state))
    return {**{k: statistics.median(v[1:]) for k, v in times.items()},
            "pack_tflop": step_flops(drafter, counts)["executed"] / 1e12,
            "muon_tflop": optimizer_flops(drafter) / 1e12}


class Matrices(nn.Module):
    """Muon's matrices alone; forward(grads) is a loss whose gradient is `grads` (DDP all-reduces it, FSDP
    reduce-scatters it: each rank then holds what a real step leaves)."""

    def __init__(self, shapes):
        super().__init__()
        self.weights = nn.ParameterList(nn.Parameter(torch.randn(s) * 0.02) for s in shapes)

    def forward(self, grads):
        return sum((w * g).sum() for w, g in zip(self.weights, grads))


def _rank(rank: int, init_file: str, shapes: list, steps: int, out: dict):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    ctx = DistContext(rank, 2, rank, torch.device("cpu"))
    try:
        grads = [torch.randn(s, generator=torch.Generator().manual_seed(i)) for i, s in enumerate(shapes)]
        for mode in parallel.MODES:
            for split in (False, True):
                torch.manual_seed(0)
                matrices = Matrices(shapes)
                parallel.wrap(matrices, mode, ctx)(grads).backward()
                muon = GatheredMuon(list(matrices.parameters()), parallel.optimizer_group(ctx) if split else None,
                                    lr=0.02, adjust_lr_fn="match_rms_adamw")
                times = []
                for _ in range(steps + 1):
                    dist.barrier()
                    times.append(timed(muon.step))
                out[mode, split, rank] = statistics.median(times[1:])
    finally:
        distributed.close(ctx)


def time_two_ranks(shapes: list, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_rank, args=(str(Path(tmp) / "init"), shapes, steps, out), nprocs=2, join=True)
        return {(mode, split): max(out[mode, split, r] for r in range(2))
                for mode in parallel.MODES for split in (False, True)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", choices=FAMILY, default="dflash")
    ap.add_argument("--scale", type=int, default=4, help="divide every width of the production geometry by this")
    ap.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up")
    ap.add_argument("--threads", type=int, default=1,
                    help="CPU threads of the one-process step (1: steadier on cores other work shares)")
    ap.add_argument("--two-ranks", action="store_true", help="also time Muon split over 2 gloo ranks")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        info, drafter, pack = build_scaled(args.drafter, args.scale, Path(tmp) / "target")
        head = TargetHead(info)
        print(f"{args.drafter} at the production geometry / {args.scale}: hidden {info.hidden_size}, vocabulary "
              f"{info.vocab_size}, pack {pack.input_ids_T.numel()} tokens in 6 rows of "
              f"{round(RESPONSE_TOKENS / args.scale)} response tokens; {torch.get_num_threads()} threads, fp32")
        t = time_step(drafter, head, pack, args.steps)
    optimizers = t["GatheredMuon"] + t["AdamW"]
    print(f"forward + backward {t['forward_backward']:.2f} s ({t['pack_tflop']:.3f} TFLOP executed), Muon step "
          f"{t['GatheredMuon']:.2f} s ({t['muon_tflop']:.3f} TFLOP), AdamW step {t['AdamW']:.3f} s")
    results = {"forward_backward_s": t["forward_backward"], "muon_step_s": t["GatheredMuon"]}
    for g in (1, 2, 4):
        results[f"muon_share_g{g}"] = t["GatheredMuon"] / (g * t["forward_backward"] + optimizers)
        results[f"muon_flop_share_g{g}"] = t["muon_tflop"] / (g * t["pack_tflop"] + t["muon_tflop"])
        print(f"trainer.grad_accum={g}: Muon {results[f'muon_share_g{g}']:.1%} of the step's time (analytic FLOPs: "
              f"{results[f'muon_flop_share_g{g}']:.1%})")
    if args.two_ranks:
        ranks = time_two_ranks([shape for shape, _ in muon_matrices(drafter)], args.steps)
        for mode in parallel.MODES:
            unsplit, split = ranks[mode, False], ranks[mode, True]
            results[f"{mode}_split_speedup"] = unsplit / split
            print(f"2 ranks, {mode}: Muon step {unsplit:.2f} s unsplit, {split:.2f} s split ({unsplit / split:.2f}x)")
    for key, value in results.items():
        print(f"{args.drafter}_{key}: {value:.4g}")


if __name__ == "__main__":
    main()
