"""What shipping and computing only what the loss reads buys the trainer, A/B in one process (not a test):
`python bench/positions_ab.py [--drafters dflash,eagle3,dflash+dflash2,...] [--pack 32768] [--steps 3] [--small]`.

Two ways to train the same mission rows (~5k-token prompts, 30-60-token responses; bench/drafter_steps.py
mission_rows at the pack), steps interleaved so that the machine's load falls on both alike:
  before  feature_server.positions=all, trainer.compute=all: every position of every layer shipped, packed by whole
          rows (~6 a 32k pack), every position computed;
  after   feature_server.positions=read, trainer.compute=read (the defaults): each layer's positions the drafters
          read (core/contract.py), packed by what ships, only what a loss reads computed.
Packs are planned as the feed plans them (data/packing.py over the shipped positions) and built by core/batch.py's
pack() from random bf16 states; each step is the trainer's (bench/drafter_steps.py make_step: fp32 cast, forward,
backward, clip, Muon + AdamW). A `+`-joined group steps each drafter in turn on the same pack, as a run's _step.
The feed, its rings and the workers are left out (bench/drafter_steps.py --fed times them): this is trainer time.

Prints per drafter (or group) and way, then `name: value` lines:
  {name}_{way}_response_tokens_per_s   response tokens trained per second of steps (every drafter of a group)
  {name}_{way}_bytes_per_response_token   target-state bytes shipped per response token (bf16), over all the rows
  {name}_{way}_rows_per_pack, {name}_{way}_anchors_per_pack   rows per pack; anchor blocks scored (first drafter)
  {name}_speedup, {name}_bytes_ratio   after / before response tokens per second; before / after bytes
"""

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from bench.drafter_steps import build, make_step, mission_rows  # noqa: E402
from bench.production_target import PRODUCTION, SMALL, write_target  # noqa: E402
from specdistill.core.batch import pack, shipped_starts, shipped_tokens  # noqa: E402
from specdistill.core.contract import FeatureSample, FeatureSpec  # noqa: E402
from specdistill.core.rows import as_rows  # noqa: E402
from specdistill.core.shapes import StaticShapes  # noqa: E402
from specdistill.core.target import TargetHead  # noqa: E402
from specdistill.data.packing import plan_packs  # noqa: E402

WAYS = {"before": ("all", "all"), "after": ("read", "read")}  # (feature_server.positions, trainer.compute)


def packs_of(rows, spec: FeatureSpec, pack_tokens: int, count: int, hidden: int) -> list:
    """The first `count` packs of `rows` as the feed plans and the workers ship them (random bf16 states)."""
    plan = plan_packs(shipped_tokens(as_rows(rows), spec), pack_tokens)[:count]
    g = torch.Generator().manual_seed(0)
    out = []
    for members in plan:
        samples = [FeatureSample(r.row_id, torch.tensor(r.input_ids), torch.tensor(r.loss_mask, dtype=torch.bool),
                                 torch.randn(r.num_tokens, len(spec.layer_ids), hidden, generator=g).bfloat16())
                   for r in (rows[int(i)] for i in members)]
        out.append(pack(samples, spec))
    return out


def bytes_per_response_token(rows, spec: FeatureSpec, hidden: int) -> float:
    """Target-state bytes the workers ship for `rows` (bf16: 2 bytes a value) per response token, over all of them
    (both ways count the same rows)."""
    rows = as_rows(rows)
    context, response = shipped_starts(rows, spec)
    lengths = rows.num_tokens
    values = ((lengths - context) * len(spec.context_layer_ids)
              + (lengths - response) * len(spec.response_layer_ids)).sum() * hidden
    return 2 * float(values) / float(rows.response_tokens().sum())


def bench(names: list[str], info, head, args, device) -> dict:
    rows = mission_rows((args.steps + 1) * 17, args.pack, seed=1)  # enough for steps + 1 packs of ~15 shipped rows
    ways = {}
    for way, (positions, compute) in WAYS.items():
        drafters = [build(name, info, device) for name in names]
        for drafter in drafters:
            drafter.compute = compute
        spec = FeatureSpec.union([d.feature_spec() for d in drafters], "bfloat16", positions)
        steps = [make_step(d, head, device, args.precision == "bf16", StaticShapes(args.pack, pad=False))
                 for d in drafters]
        packs = packs_of(rows, spec, args.pack, args.steps + 1, info.hidden_size)
        if len(packs) < args.steps + 1:
            raise SystemExit(f"{'+'.join(names)}: {len(packs)} packs of these rows, need {args.steps + 1}")
        ways[way] = {"steps": steps, "packs": packs, "times": [], "anchors": [],
                     "bytes": bytes_per_response_token(rows, spec, info.hidden_size)}
    for i in range(args.steps + 1):  # step 0 warms up each way; then interleaved
        for way, w in ways.items():
            batch = w["packs"][i].to(device, torch.float32)
            t = time.perf_counter()
            outs = [step(batch) for step in w["steps"]]
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i:
                w["times"].append(time.perf_counter() - t)
                w["anchors"].append(float(outs[0].blocks))
    out = {}
    for way, w in ways.items():
        packs = w["packs"][1:]
        response = sum(int(b.loss_mask_T.sum()) for b in packs)
        out[way] = {"response_tokens_per_s": response / sum(w["times"]),
                    "bytes_per_response_token": w["bytes"],
                    "rows_per_pack": statistics.mean(len(b.row_ids) for b in packs),
                    "anchors_per_pack": statistics.mean(w["anchors"]),
                    "step_s": statistics.median(w["times"])}
    out["speedup"] = out["after"]["response_tokens_per_s"] / out["before"]["response_tokens_per_s"]
    out["bytes_ratio"] = out["before"]["bytes_per_response_token"] / out["after"]["bytes_per_response_token"]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--drafters", default="dflash,dspark,dflash2,eagle3,mtp,dflash+dflash2,dflash2+eagle3")
    ap.add_argument("--pack", type=int, default=32768)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per way, after one warm-up step each")
    ap.add_argument("--precision", choices=("bf16", "fp32"), default=None)
    ap.add_argument("--small", action="store_true", help="tiny target dims (hidden 256, vocab 4096), for a CPU")
    args = ap.parse_args()
    device = torch.device(args.device)
    args.precision = args.precision or ("bf16" if device.type == "cuda" else "fp32")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        info = write_target(Path(tmp) / "target", SMALL if args.small else PRODUCTION, device)
        head = TargetHead(info).to(device)
        print(f"target: hidden {info.hidden_size}, vocab {info.vocab_size}; pack {args.pack}; {args.precision}; "
              f"{args.steps} timed steps per way, interleaved")
        for group in args.drafters.split(","):
            r = results[group] = bench(group.split("+"), info, head, args, device)
            for way in WAYS:
                w = r[way]
                print(f"{group} {way}: {w['response_tokens_per_s']:.1f} response tokens/s (step {w['step_s']:.2f} s), "
                      f"{w['rows_per_pack']:.1f} rows and {w['anchors_per_pack']:.0f} anchors a pack, "
                      f"{w['bytes_per_response_token'] / 2**20:.3f} MiB of states per response token", flush=True)
            print(f"{group}: {r['speedup']:.2f}x response tokens per second, {r['bytes_ratio']:.2f}x fewer bytes",
                  flush=True)
    for group, r in results.items():
        for way in WAYS:
            for key in ("response_tokens_per_s", "bytes_per_response_token", "rows_per_pack", "anchors_per_pack"):
                print(f"{group}_{way}_{key}: {r[way][key]:.4g}")
        print(f"{group}_speedup: {r['speedup']:.3f}")
        print(f"{group}_bytes_ratio: {r['bytes_ratio']:.3f}")


if __name__ == "__main__":
    main()
