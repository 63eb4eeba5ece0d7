"""Drafter train steps at production shapes (not a test): `python bench/drafter_steps.py [--device cuda]
[--drafters mtp,eagle3,dflash+dflash2,...] [--pack 32768] [--response-tokens 45] [--steps 5] [--fed [--workers 3]
[--positions read|all]] [--small] [--compute read|all]`.

The target is Qwen3.5-35B-A3B's text geometry (hidden 2048, 40 layers = 30 gated-DeltaNet + 10 full attention,
vocabulary 248,320, 16 query / 2 KV heads of 256, MoE of 256 experts top-8 of width 512 + a shared expert of 512, one
MTP layer). Its weights are random: a step's time does not depend on their values. The target directory holds only
config.json and the three tensors the trainer reads (embeddings, final norm, lm_head); MTP's layer starts from random
weights instead of the checkpoint's mtp.* tensors.

Two ways to feed the step, per drafter:
- fixed: one pack already on the device, repeated: 32,768 tokens of six ~5.4k-token rows, each ending in a
  `--response-tokens` (45) response (the only scored tokens). This leaves out what a run does between steps.
- fed (--fed): the path a run takes. Synthetic producers (feature_server.backend=synthetic) write each row's bf16
  states into the real shared-memory rings; the trainer's FeatureFeed plans packs, copies each sample once into its
  pack's buffer (pinned on CUDA) and issues the copy to the device on a side stream; the step waits on it and casts
  on the device. Rows are mission-shaped and vary in length (4.0k-6.7k tokens at the 32k pack, responses of 30-60),
  so packs and anchor counts vary as a run's do, padded to the run's fixed shapes on CUDA (core/shapes.py). The
  workers ship what the drafters read (`--positions read`, the default: feature_server.positions) or every position
  (`all`), and the planner packs by what ships (docs/scaling.md, "What ships"). A `+`-joined group
  (`dflash+dflash2`) is several drafters of one run: fed only, each steps in turn on the same packs.
Every drafter runs with its production defaults (specdistill/conf/drafter/*.yaml = the config dataclasses) and a step is the
trainer's (specdistill/trainer/trainer.py `_step`): the pack cast to fp32 on the device, bf16 autocast over fp32
master weights, forward + loss + backward, gradient clip, Muon + AdamW step (specdistill/trainer/optim.py), zero_grad.

Per drafter (after `--warmup` steps, which include flex attention's compilation), the median over `--steps` steps:
  {name}_step_ms, {name}_tokens_per_s       fixed pack: its tokens per second on one trainer GPU
  {name}_fed_step_ms, {name}_fed_tokens_per_s   fed: the same, real (unpadded) tokens per second
  {name}_fed_vs_fixed                       fed / fixed step time (goal on a GPU: <= 1.1)
  {name}_fed_wait_fraction                  the fed steps' share spent waiting for the feed (0: supply >= demand)
  {name}_fed_response_tokens_per_s          response tokens trained per second of fed steps (every drafter of a group)
  {name}_fed_bytes_per_response_token       target-state bytes the workers shipped per response token
  {name}_fed_rows_per_pack, _fed_anchors_per_pack   rows per fed pack; anchor blocks scored per pack (first drafter)
  {name}_compiled_shapes                    attention shapes the drafter's steps gave (core/shapes.py)
  {name}_peak_gib                           peak CUDA memory of a fixed step (0 on CPU)
  {name}_model_tflop                        the step's work by bench/step_flops.py's analytic count (real tokens)
  {name}_mfu, {name}_fed_mfu                model FLOPs / step time / the dense bf16 peak (H100/H200: 989 TFLOP/s)
  {name}_vs_matmul                          model FLOP rate / an 8192^3 bf16 matmul's measured rate here
and with --count-flops (CPU, or CUDA with no compiled flex attention in the step):
  {name}_counted_tflop                      FLOPs of one step as torch's FlopCounterMode counts them
The analytic count (docs/scaling.md, "FLOPs of a training step") credits only work a loss reads through: a drafter
that skips work (response-only logits, anchored blocks) is not credited for it, nor for padding. FlopCounterMode
counts what executes, but nothing for CPU attention kernels; on torch 2.11 + CUDA it cannot trace compiled flex
attention and the failed trace broke every later flex compilation in the process (H200, 2026-12-04), hence off by
default. `--small` shrinks the target (hidden 256, vocab 4096, pack 2048) so the script runs on a CPU for a check.
"""

import argparse
import os
import statistics
import sys
import tempfile
import time
import traceback
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# As specdistill/launch/train.py: OpenMP threads that spin would take the cores the --fed producers need.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

from specdistill.core.batch import PackedBatch, shipped_tokens  # noqa: E402
from specdistill.core.contract import FeatureSpec, TokenizedRow  # noqa: E402
from specdistill.core.rows import as_rows  # noqa: E402
from specdistill.data.packing import plan_packs  # noqa: E402
from specdistill.core.shapes import StaticShapes  # noqa: E402
from specdistill.core.target import TargetHead, TargetInfo  # noqa: E402
from specdistill.drafters import DRAFTERS, drafter_config  # noqa: E402
from specdistill.drafters.base import COMPUTE_MODES  # noqa: E402
from specdistill.feature_server.config import FeatureServerConfig  # noqa: E402
from specdistill.feature_server.server import FeatureServer  # noqa: E402
from specdistill.trainer.config import TrainerConfig  # noqa: E402
from specdistill.trainer.device_copy import DeviceCopier, on_device  # noqa: E402
from specdistill.trainer.feed import EpochEnd, FeatureFeed  # noqa: E402
from specdistill.trainer.optim import Optimizers  # noqa: E402
from bench.production_target import (DENSE_BF16_PEAK_TFLOPS, MASK_TOKEN_ID, PRODUCTION,  # noqa: E402
                                     RESPONSE_TOKENS, ROWS_PER_PACK, SMALL, mission_pack, write_target)
from bench.step_flops import pack_counts, step_flops  # noqa: E402

def build(name: str, info: TargetInfo, device):
    """The drafter with its production defaults; DFlash-family layers random (their target layers are not in
    this target directory), MTP's layer random (no mtp.* tensors)."""
    overrides = {"init_from_target": False} if name in ("dflash", "dspark", "dflash2") else {}
    cfg = drafter_config(name, overrides)
    config_cls, cls = DRAFTERS[name]
    if name == "mtp":
        with mock.patch("specdistill.drafters.mtp.read_mtp_state", lambda path, state: state), device:
            drafter = cls(cfg, info)  # initialised on the device: 0.8B expert weights
    elif name == "eagle3":
        with device:
            drafter = cls(cfg, info)
        vocab = min(info.vocab_size, 2 * cfg.draft_vocab_size)  # response tokens seen: enough for a full draft vocab
        drafter.prepare([TokenizedRow(0, tuple(range(vocab)), (1,) * vocab)])
    else:
        with device:
            drafter = cls(cfg, info, MASK_TOKEN_ID)
    return drafter.to(device).train()


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def make_step(drafter, head, device, bf16: bool, static: StaticShapes):
    """trainer.Trainer._step for one pack on one rank: step(item) takes a pack as the feed delivers it (on the host,
    or being copied to the device: specdistill/trainer/device_copy.py) and casts it to fp32 on the device."""
    cfg = TrainerConfig()
    optimizers = Optimizers(drafter, cfg)
    generator = torch.Generator().manual_seed(0)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else nullcontext()

    def step(item):
        micro = replace(on_device(item, device, torch.float32), static=static)
        step.last = (micro, generator.get_state())  # what the step saw: bench/step_flops.py counts its work
        with autocast:
            out = drafter(micro, head, generator)
        out.loss.backward()
        if not optimizers.clip_step_and_zero(drafter.parameters(), cfg.grad_clip):
            raise FloatingPointError("non-finite gradients: a step not taken would be timed as one")
        return out

    return step


def matmul_tflops(device) -> float:
    """Measured bf16 matmul rate (8192^3, mean of 10 after 3 warm-ups): the ceiling a step's matmuls can reach."""
    n = 8192 if device.type == "cuda" else 1024
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    sync(device)
    t = time.perf_counter()
    for _ in range(10):
        a @ b
    sync(device)
    return 2 * n**3 * 10 / (time.perf_counter() - t) / 1e12


def timed(step, items, device, drafter=None) -> tuple[list[float], list[float]]:
    """Seconds of each step, its item included (items() may wait for the feed), and each step's analytic model FLOPs
    (bench/step_flops.py, counted after the timed region from the pack and generator state the step saw)."""
    times, flops = [], []
    for item in items:
        sync(device)
        t = time.perf_counter()
        step(item())
        sync(device)
        times.append(time.perf_counter() - t)
        if drafter is not None:
            batch, state = step.last
            flops.append(step_flops(drafter, pack_counts(drafter, batch, torch.Generator().set_state(state)))["model"])
    return times, flops


def bench_drafter(name: str, info: TargetInfo, head: TargetHead, args, device, target_dir: Path) -> dict:
    drafter = build(name, info, device)
    drafter.compute = args.compute  # as the trainer sets it from trainer.compute
    batch = mission_pack(info, drafter.feature_spec().layer_ids, args.pack, device,
                         response_tokens=args.response_tokens)
    static = StaticShapes(tokens=args.pack, pad=device.type == "cuda")  # as a run lays packs out (core/shapes.py)
    step = make_step(drafter, head, device, args.precision == "bf16", static)
    t = time.perf_counter()
    for _ in range(args.warmup):
        step(batch)
    sync(device)
    warmup_s = time.perf_counter() - t
    counted = float("nan")
    if args.count_flops:
        with FlopCounterMode(display=False) as counter:
            step(batch)
        counted = counter.get_total_flops()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, flops = timed(step, [lambda: batch] * args.steps, device, drafter)
    step_s = statistics.median(times)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
    params = sum(p.numel() for p in drafter.parameters() if p.requires_grad)
    out = {"step_ms": step_s * 1e3, "tokens_per_s": args.pack / step_s, "peak_gib": peak,
           "model_tflop": statistics.median(flops) / 1e12, "model_tflops": statistics.median(flops) / step_s / 1e12,
           "counted_tflop": counted / 1e12, "warmup_s": warmup_s, "trainable_params_m": params / 1e6}
    del batch
    if args.fed:
        out.update(bench_fed([drafter], [step], static, args, device, target_dir))
    out["compiled_shapes"] = static.count
    del drafter, step
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def mission_rows(n: int, pack_tokens: int, seed: int = 0) -> list[TokenizedRow]:
    """n rows of the mission's shape scaled to the pack: ROWS_PER_PACK per pack on average, lengths spread +-25%
    around that (the planned packs then fill ~0.97 and vary in length), responses of 30-60 tokens."""
    g = torch.Generator().manual_seed(seed)
    mean = pack_tokens // ROWS_PER_PACK * 0.95
    rows = []
    for i in range(n):
        T = int(mean * (0.75 + 0.5 * torch.rand((), generator=g)))
        r = min(T - 1, int(torch.randint(30, 61, (), generator=g)))
        rows.append(TokenizedRow(i, tuple(torch.randint(4, 4000, (T,), generator=g).tolist()), (0,) * (T - r) + (1,) * r))
    return rows


def fed_rows(spec: FeatureSpec, packs: int, pack_tokens: int) -> list[TokenizedRow]:
    """Mission rows enough for `packs` planned packs of what `spec` ships (+15%)."""
    n = int(packs * ROWS_PER_PACK * 1.15)
    while True:
        rows = mission_rows(n, pack_tokens, seed=1)
        if len(plan_packs(shipped_tokens(as_rows(rows), spec), pack_tokens)) > packs:
            return rows
        n *= 2


def bench_fed(drafters: list, steps: list, static: StaticShapes, args, device, target_dir: Path) -> dict:
    """The step as a run feeds it: synthetic producers (feature_server.backend=synthetic, one copy of each row's
    bf16 states into their shared-memory rings, as vLLM's hand-off makes) -> the trainer's FeatureFeed (planned
    packs, each sample copied once into its pack's buffer: pinned on CUDA) -> the side-stream copy to the device ->
    the cast there -> the step of each drafter in turn. Rows vary in length, so packs and anchor counts vary as a
    run's do. The workers ship what the drafters read (args.positions), as a run's do."""
    spec = FeatureSpec.union([d.feature_spec() for d in drafters], "bfloat16", args.positions)
    info = drafters[0].target
    pack_bytes = args.pack * len(spec.layer_ids) * info.hidden_size * 2
    workers = args.workers
    config = FeatureServerConfig(backend="synthetic", workers=workers, batch_tokens=args.pack,
                                 capacity_mb=workers * 2 * -(-pack_bytes // 2**20) + 64)  # 2 packs per ring
    rows = fed_rows(spec, args.warmup + args.steps + 2, args.pack)
    copier = DeviceCopier(device) if device.type == "cuda" else None

    def server():
        return FeatureServer(str(target_dir), spec, None, config, devices=["cpu"] * workers,
                             max_row_tokens=max(r.num_tokens for r in rows),
                             shm_prefix=f"specdistill_bench_{os.getpid()}")

    waits: list[float] = []
    packs: list[PackedBatch] = []

    def step_all(item):
        micro = on_device(item, device, torch.float32)  # cast once, every drafter reads it (trainer.StepPacks)
        return [step(micro) for step in steps]

    with FeatureFeed(server, rows, token_budget=args.pack, spec=spec, grad_accum=1, prefetch=2,
                     max_epochs=1000, pad_to=args.pack if static.pad else None, copier=copier) as feed:
        def next_pack():
            t = time.perf_counter()
            item = feed.next()
            while isinstance(item, EpochEnd):
                item = feed.next()
            waits.append(time.perf_counter() - t)
            packs.append(item[0].batch if copier else item[0])
            return item[0]

        timed(step_all, [next_pack] * args.warmup, device)  # the engines start, shapes compile
        waits.clear(), packs.clear()
        blocks = []
        step_all.last = None
        times, flops = [], []
        for _ in range(args.steps):
            item = next_pack()
            sync(device)
            t = time.perf_counter()
            outs = step_all(item)
            sync(device)
            times.append(time.perf_counter() - t + waits[-1])
            blocks.append(float(outs[0].blocks))
            if len(drafters) == 1:
                batch, state = steps[0].last
                flops.append(step_flops(drafters[0], pack_counts(drafters[0], batch,
                                                                 torch.Generator().set_state(state)))["model"])
    fed_s = statistics.median(times)
    real = [b.num_real_tokens for b in packs]
    response = [int(b.loss_mask_T.sum()) for b in packs]
    shipped = [(b.num_real_tokens * len(b.layer_ids) + b.num_response_positions * len(b.response_layer_ids))
               * info.hidden_size * 2 for b in packs]
    return {"fed_step_ms": fed_s * 1e3, "fed_tokens_per_s": sum(real) / sum(times),
            "fed_model_tflops": sum(flops) / sum(times) / 1e12 if flops else float("nan"),
            "fed_response_tokens_per_s": sum(response) / sum(times),
            "fed_bytes_per_response_token": sum(shipped) / sum(response),
            "fed_rows_per_pack": statistics.mean(len(b.row_ids) for b in packs),
            "fed_anchors_per_pack": statistics.mean(blocks),
            "fed_wait_fraction": sum(waits) / sum(times), "fed_pack_fill": sum(real) / (len(real) * args.pack),
            "pinned_pool_mib": copier.pool.peak_bytes / 2**20 if copier else 0.0, "max_open_packs": feed.max_open_packs}


def bench_group(names: list[str], info: TargetInfo, head: TargetHead, args, device, target_dir: Path) -> dict:
    """Several drafters of one run, fed the same packs (the trainer's _step: each steps in turn)."""
    drafters = [build(name, info, device) for name in names]
    statics = [StaticShapes(tokens=args.pack, pad=device.type == "cuda") for _ in drafters]  # one per entry
    for drafter in drafters:
        drafter.compute = args.compute
    steps = [make_step(d, head, device, args.precision == "bf16", static) for d, static in zip(drafters, statics)]
    out = bench_fed(drafters, steps, statics[0], args, device, target_dir)
    out["compiled_shapes"] = sum(static.count for static in statics)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--drafters", default="dflash,mtp,eagle3,dspark,dflash2")
    ap.add_argument("--pack", type=int, default=None, help="tokens per pack (default 32768; --small: 2048)")
    ap.add_argument("--response-tokens", type=int, default=RESPONSE_TOKENS,
                    help="fixed pack: scored tokens per row (45: the mission's; 171 fills 1,024 anchors at 32k)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--compute", choices=COMPUTE_MODES, default="read",
                    help="trainer.compute: read (only what a loss reads) or all (every position: the reference)")
    ap.add_argument("--precision", choices=("bf16", "fp32"), default=None,
                    help="bf16 autocast over fp32 weights (default on CUDA, as the trainer) or fp32 (default on CPU)")
    ap.add_argument("--count-flops", action="store_true",
                    help="FlopCounterMode over one step (not with compiled flex attention: see the docstring)")
    ap.add_argument("--small", action="store_true", help="tiny target dims and pack, for a CPU check")
    ap.add_argument("--fed", action="store_true",
                    help="also time the step fed as a run feeds it: synthetic producers -> rings -> feed -> device")
    ap.add_argument("--workers", type=int, default=3,
                    help="--fed: synthetic feature workers (3: a trainer GPU's share of a node's 6)")
    ap.add_argument("--positions", choices=("read", "all"), default="read",
                    help="--fed: what the workers ship (feature_server.positions)")
    args = ap.parse_args()
    args.pack = args.pack or (2048 if args.small else 32768)
    device = torch.device(args.device)
    args.precision = args.precision or ("bf16" if device.type == "cuda" else "fp32")
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = next((v for k, v in DENSE_BF16_PEAK_TFLOPS.items() if k in gpu), None)
    ceiling = matmul_tflops(device)
    print(f"device: {gpu}; dense bf16 peak {peak} TFLOP/s (spec); measured matmul {ceiling:.0f} TFLOP/s")
    results, failed = {}, []
    with tempfile.TemporaryDirectory() as tmp:
        info = write_target(Path(tmp) / "target", SMALL if args.small else PRODUCTION, device)
        head = TargetHead(info).to(device)
        print(f"target: hidden {info.hidden_size}, vocab {info.vocab_size}, {info.num_hidden_layers} layers; "
              f"pack {args.pack} tokens = {ROWS_PER_PACK} rows x ~{args.pack // ROWS_PER_PACK} tokens, "
              f"{args.response_tokens} scored each; {args.precision}" + (" autocast" if args.precision == "bf16" else "")
              + f"; compute={args.compute}")
        for name in args.drafters.split(","):
            try:
                if "+" in name:
                    if not args.fed:
                        raise SystemExit(f"--drafters {name}: a group of drafters is measured fed only (--fed)")
                    results[name] = r = bench_group(name.split("+"), info, head, args, device, Path(tmp) / "target")
                    _print_fed(name, r)
                    continue
                r = bench_drafter(name, info, head, args, device, Path(tmp) / "target")
            except Exception:  # the next drafter still runs; the exit status says one failed
                traceback.print_exc()
                print(f"{name}: FAILED", flush=True)
                failed.append(name)
                continue
            r["mfu"] = r["model_tflops"] / peak if peak else float("nan")
            r["vs_matmul"] = r["model_tflops"] / ceiling
            results[name] = r
            print(f"{name}: {r['trainable_params_m']:.0f}M trainable, warm-up {r['warmup_s']:.1f} s, "
                  f"step {r['step_ms']:.1f} ms, {r['tokens_per_s']:,.0f} tokens/s, peak {r['peak_gib']:.1f} GiB, "
                  f"{r['model_tflop']:.3g} TFLOP of model work ({r['model_tflops']:.1f} TFLOP/s, MFU {r['mfu']:.3f}), "
                  f"{r['compiled_shapes']} attention shapes", flush=True)
            if args.fed:
                r["fed_vs_fixed"] = r["fed_step_ms"] / r["step_ms"]
                r["fed_mfu"] = r["fed_model_tflops"] / peak if peak else float("nan")
                _print_fed(name, r)
    for name, r in results.items():
        for key in ("step_ms", "tokens_per_s", "peak_gib", "model_tflop", "mfu", "vs_matmul", "counted_tflop",
                    "fed_step_ms", "fed_tokens_per_s", "fed_vs_fixed", "fed_mfu", "fed_wait_fraction",
                    "fed_pack_fill", "fed_response_tokens_per_s", "fed_bytes_per_response_token",
                    "fed_rows_per_pack", "fed_anchors_per_pack", "compiled_shapes"):
            if key in r and r[key] == r[key]:  # not NaN: a peak known, FLOPs counted
                print(f"{name}_{key}: {r[key]:.4g}")
    if failed:
        raise SystemExit(f"drafter steps failed: {failed}")


def _print_fed(name: str, r: dict) -> None:
    vs_fixed = f" ({r['fed_vs_fixed']:.2f}x the fixed pack)" if "fed_vs_fixed" in r else ""
    print(f"{name} fed: step {r['fed_step_ms']:.1f} ms{vs_fixed}, {r['fed_tokens_per_s']:,.0f} real tokens/s, "
          f"{r['fed_response_tokens_per_s']:,.1f} response tokens/s, {r['fed_rows_per_pack']:.1f} rows and "
          f"{r['fed_anchors_per_pack']:.0f} anchors a pack, {r['fed_bytes_per_response_token'] / 2**20:.2f} MiB of "
          f"states per response token, waiting for features {r['fed_wait_fraction']:.1%} of it, pack fill "
          f"{r['fed_pack_fill']:.3f}, pinned pool {r['pinned_pool_mib']:.0f} MiB, at most {r['max_open_packs']} "
          "packs assembled at once", flush=True)


if __name__ == "__main__":
    main()
