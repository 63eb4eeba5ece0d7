"""`make demo`: the whole chain on the default target (tiny-qwen3-next), sized for 2 CPU cores, ending on vLLM.

1. Builds the tiny target and the synthetic workload (cached), trains DFlash with online features and exports it
   in speculators format, through the real CLI (what it prints is what `python -m launch.train` produces).
2. Serves the export with vLLM next to the target, and the target alone, on held-out prompts
   (bench/vllm_acceptance.py), and walks the same prompts and continuations offline.
3. Prints tau_vllm, tau_offline on those prompts, the gap and whether the outputs were identical; a gap above
   MAX_GAP_PCT for the target's dtype is printed as a failure and the demo exits non-zero.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.prompts import read_prompts  # noqa: E402
from bench.vllm_acceptance import identical_prefixes, served_vs_offline  # noqa: E402
from core.run_dir import RunDir  # noqa: E402

RUN_DIR = Path("outputs/demo")
# The embedded default (conf/config.yaml) with a drafter sized for 2 cores: the production DFlash
# (5 layers, 1024 anchors, 4096-token packs) takes tens of seconds per step there.
# The worker computes the target in fp32 (feature_server.dtype): these CPUs have no bf16 arithmetic, and a bf16
# prefill of tiny-qwen3-next takes 3.3x as long as fp32 (0.157 vs 0.048 s per 400-token row, one thread), so in
# bf16 one worker cannot keep up with the step and the trainer waits (measured: 19.8 s of waiting for 10.8 s of
# steps; in fp32 0.05 s). The states still cross in bf16 (feature_server.hidden_dtype), and the served check below
# runs the target in bf16 on vLLM and walks bf16 states offline (docs/scaling.md, "Prefetch, ring capacity and CPU
# threads").
OVERRIDES = ["drafter=dflash", "target=tiny-qwen3-next", "drafter.num_layers=2", "drafter.max_anchors=256",
             "trainer.token_budget=2048", "trainer.max_steps=60", "feature_server.dtype=float32",
             f"hydra.run.dir={RUN_DIR}"]
SERVED_PROMPTS = 8
# Served continuations are as long as the shortest held-out response of those prompts: the served check runs with
# ignore_eos (so both runs produce the same lengths), and tokens past the response's end are not this workload.
MAX_SERVED_TOKENS = 32
# fp32 targets serve exactly what the offline walk computes; bf16 hybrids differ by near-ties (docs/acceptance.md).
MAX_GAP_PCT = {"float32": 5.0, "bfloat16": 10.0}


def train() -> dict:
    cmd = [sys.executable, "-m", "launch.train", *OVERRIDES, *sys.argv[1:]]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    return json.loads(RunDir(RUN_DIR).metrics.read_text())


def served(m: dict) -> dict:
    heldout = _heldout_path(m)
    prompts, stages = read_prompts(heldout, None, SERVED_PROMPTS)
    tokens = min(MAX_SERVED_TOKENS, *_response_lengths(heldout, SERVED_PROMPTS))
    result = served_vs_offline(RUN_DIR, m["target"], "dflash", prompts, tokens, stages)
    spec, offline = result["spec"], result["offline"].total
    return {"tau_vllm": spec.tau_per_step, "tau_offline": offline.tau,
            "gap_pct": 100.0 * (spec.tau_per_step - offline.tau) / offline.tau,
            "identical": identical_prefixes(result["base"], spec, tokens), "prompts": len(prompts),
            "accepted": spec.counters.num_accepted_tokens, "tokens": tokens}


def _response_lengths(path: str, n: int) -> list[int]:
    """Response tokens (loss_mask ones) of the first n rows with a response (bench.prompts.read_prompts' rows)."""
    lengths = []
    with open(path) as f:
        for line in f:
            if line.strip() and (ones := sum(json.loads(line)["loss_mask"])):
                lengths.append(ones)
                if len(lengths) == n:
                    break
    return lengths


def _heldout_path(m: dict) -> str:
    """The held-out file the run read (synthetic workloads live in the cache)."""
    return m["skipped_rows"]["heldout"]["path"]


def main() -> int:
    started = time.perf_counter()
    m = train()
    trained = time.perf_counter()
    print(f"\nexport: {Path(m['export_dir']).resolve()} (weights of step {m['export_selected']['step']}, "
          f"{m['export_selected']['policy']} held-out tau)")
    print(f"tau_offline (held-out, {m['heldout_drafts']} drafts, K={m['num_speculative_tokens']}): {m['tau_offline']:.3f}")
    print("per_position_acceptance: " + " ".join(f"{a:.2f}" for a in m["per_position_acceptance"]))
    print(f"time: feature extraction {m['feature_extraction_seconds']:.1f} s (worker-side), "
          f"training {m['training_seconds']:.1f} s, waiting for features {m['feature_wait_seconds']:.1f} s "
          f"({m['feature_wait_seconds'] / max(m['training_seconds'], 1e-9):.1%} of training), "
          f"train wall {trained - started:.1f} s (incl. target/data build on a fresh cache)")
    s = served(m)
    dtype = json.loads((Path(m["target"]) / "config.json").read_text()).get("dtype") or "float32"
    limit = MAX_GAP_PCT.get(dtype, 10.0)
    ok = abs(s["gap_pct"]) <= limit and s["accepted"] > 0
    print(f"\nserved on vLLM ({s['prompts']} held-out prompts, {s['tokens']} tokens each, target {dtype}):")
    print(f"tau_vllm: {s['tau_vllm']:.3f}")
    print(f"tau_offline: {s['tau_offline']:.3f}  (same prompts, same continuations)")
    print(f"gap_pct: {s['gap_pct']:+.2f}  ({'OK' if ok else 'FAIL'}: limit {limit:.0f}% for {dtype})")
    print(f"identical_outputs: {s['identical']}/{s['prompts']}")
    print(f"demo wall: {time.perf_counter() - started:.1f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
