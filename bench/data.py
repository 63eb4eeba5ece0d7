"""Data at the mission's scale (not a test): `python bench/data.py [--small 20000] [--large 200000]`, or
`python bench/data.py --one-row-group 50000 [--processes 2]`.

Builds mission-shaped datasets at two sizes and measures what a run pays for its data, in fresh processes as a
trainer rank would:
  small  --small chat rows (JSONL: system prompt of catalogue snippets, ~5k-token prompts spread lognormal(0.3),
         JSON responses; specdistill/data/workload.py), tokenized for real by the token store (specdistill/data/token_store.py)
  large  --large pre-tokenized rows (Parquet input_ids / loss_mask: the small set's rows repeated, so lengths stay
         mission-shaped; tokenizing 1 B tokens of chat text would take ~an hour on 2 cores)
For each: the first start (no store: tokenize or ingest, then select the rows for 32,768-token packs and plan the
epoch's packs), a restart (the store exists: map it, select, plan), and a rank's memory after it has also built the
exactly-once ledger over its shard and walked every row once (as the feed does when it hands rows to workers).
Memory is RssAnon (anonymous pages: what the process owns); the token files' pages are mapped (RssFile), shared with
every other process of the node and reclaimable, reported beside it.
Last lines (`name: value`):
  tokenize_tokens_per_s        small set's first build, all processes
  first_start_s_small / first_start_s_large / restart_s_small / restart_s_large
  restart_vs_first             restart / first start, small set (goal <= 0.1)
  trainer_rss_mb_small / trainer_rss_mb_large        RssAnon of a rank after the walk
  rss_growth_per_100k_rows_mb  (large - small) / (rows difference / 100k) (goal <= 50: the index only)
  pack_fill                    real tokens / pack tokens of the planned epoch at 32,768 (goal >= 0.95)
--one-row-group N measures one thing instead: N mission-shaped chat rows written as a Parquet file of ONE row group
(what pyarrow writes by default up to ~1M rows) and tokenized into a token store by --processes processes, as a
run's first start does (load_selected, data.tokenize_workers); last lines:
  one_row_group_rows_per_s / one_row_group_tokens_per_s   store rows (= input rows here) and tokens per second
  one_row_group_processes      processes the build used (meta.json build_processes)
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

PACK = 32768


def write_chat_jsonl(path: Path, rows: int, prompt_tokens: int) -> None:
    from specdistill.data.workload import generate_rows

    with path.open("w") as f:
        for start in range(0, rows, 2600):  # sessions of 26 calls; written in pieces to bound memory
            for r in generate_rows(min(2600, rows - start), seed=start, prompt_tokens=prompt_tokens, prompt_spread=0.3):
                f.write(json.dumps(r) + "\n")


def write_pretokenized_parquet(path: Path, store_dir: Path, rows: int) -> None:
    """`rows` rows cycling through the small store's rows (their real lengths and masks), row groups of 10k."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from specdistill.data.token_store import TokenStore

    store = TokenStore(store_dir)
    n = len(store)
    writer = None
    for start in range(0, rows, 10_000):
        idx = np.arange(start, min(rows, start + 10_000)) % n
        lengths = store.lengths[idx]
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        spans = np.concatenate([np.arange(store.offsets[i], store.offsets[i + 1]) for i in idx])
        ids = pa.ListArray.from_arrays(pa.array(offsets), pa.array(store.tokens[spans].astype(np.int32)))
        mask = pa.ListArray.from_arrays(pa.array(offsets), pa.array(store.loss_mask[spans].astype(np.int8)))
        table = pa.table({"input_ids": ids, "loss_mask": mask})
        writer = writer or pq.ParquetWriter(str(path), table.schema)
        writer.write_table(table)
    writer.close()


def write_chat_parquet_one_row_group(path: Path, rows: int, prompt_tokens: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from specdistill.data.workload import generate_rows

    table = pa.concat_tables(pa.Table.from_pylist(generate_rows(min(2600, rows - start), seed=start,
                                                                prompt_tokens=prompt_tokens, prompt_spread=0.3))
                             for start in range(0, rows, 2600))
    pq.write_table(table, str(path), row_group_size=rows)  # one row group


def start_once(path: Path, tok_dir: Path, cache: Path, walk: bool, processes: int | None = None) -> dict:
    """One fresh process: open (or build) the store, select rows for PACK-token packs, plan rank 0 of 2's epoch;
    with `walk`, build the ledger over the planned stream and read every row once. Returns its figures."""
    code = f"""
import json, time, numpy as np
t0 = time.perf_counter()
from specdistill.data.config import DataConfig
from specdistill.data.selection import load_selected
from specdistill.data.packing import plan_packs, pack_fill
from specdistill.feature_server.ledger import shard_rows, SampleLedger
from specdistill.core.contract import FeatureSpec
rows, report, store = load_selected({str(path)!r}, {str(tok_dir)!r}, {str(cache)!r}, {PACK}, DataConfig(tokenize_workers={processes!r}), progress=False)
mine = shard_rows(rows, 0, 2)
packs = plan_packs(mine.num_tokens, {PACK})
ordered = mine.take(np.concatenate(packs))
ready_s = time.perf_counter() - t0
out = {{"ready_s": ready_s, "rows": len(rows), "skipped": report.skipped, "fill": pack_fill(mine.num_tokens, packs, {PACK}),
        "tokens": int(rows.num_tokens.sum()), "build": store.meta["tokens_per_s"], "build_processes": store.meta["build_processes"],
        "build_rows_per_s": store.meta["rows"] / store.meta["build_seconds"]}}
if {walk}:
    ledger = SampleLedger(FeatureSpec((1,)), ordered)
    consumed = set()
    while ledger.has_pending:
        for r in ledger.assign(0, 1):  # one row at a time, as the server tops workers up
            consumed.add(r.row_id)  # the trainer's per-epoch record (checkpointed)
    status = dict(line.split(":", 1) for line in open("/proc/self/status") if line.startswith(("RssAnon", "RssFile")))
    out.update(rss_anon_mb=int(status["RssAnon"].split()[0]) / 1024, rss_file_mb=int(status["RssFile"].split()[0]) / 1024)
print("RESULT " + json.dumps(out))
"""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    if done.returncode:
        raise SystemExit(f"bench process failed:\n{done.stderr[-4000:]}")
    line = next(ln for ln in done.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", type=int, default=20_000)
    ap.add_argument("--large", type=int, default=200_000)
    ap.add_argument("--prompt-tokens", type=int, default=5000, help="median prompt length")
    ap.add_argument("--dir", help="work directory (default: a temporary one, removed after)")
    ap.add_argument("--one-row-group", type=int, metavar="N",
                    help="only: tokenize N chat rows from a one-row-group Parquet file (see the docstring)")
    ap.add_argument("--processes", type=int, default=2, help="--one-row-group: data.tokenize_workers")
    a = ap.parse_args()
    from specdistill.launch.tokenizer import save_tokenizer, workload_tokenizer

    if a.one_row_group:
        return one_row_group(a)

    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        root = Path(tmp)
        tok_dir = root / "tokenizer"
        tok_dir.mkdir()
        save_tokenizer(workload_tokenizer(), tok_dir)
        small, large, cache = root / "small.jsonl", root / "large.parquet", root / "cache"
        t0 = time.perf_counter()
        write_chat_jsonl(small, a.small, a.prompt_tokens)
        print(f"wrote {small} ({small.stat().st_size / 2**20:.0f} MiB, {a.small} rows) in {time.perf_counter() - t0:.0f} s")
        first_small = start_once(small, tok_dir, cache, walk=False)
        restart_small = start_once(small, tok_dir, cache, walk=True)
        from specdistill.data.token_store import store_key

        t0 = time.perf_counter()
        write_pretokenized_parquet(large, cache / "tokens" / store_key(small, tok_dir, cache), a.large)
        print(f"wrote {large} ({large.stat().st_size / 2**20:.0f} MiB, {a.large} rows) in {time.perf_counter() - t0:.0f} s")
        first_large = start_once(large, tok_dir, cache, walk=False)
        restart_large = start_once(large, tok_dir, cache, walk=True)
    for name, r in (("small", restart_small), ("large", restart_large)):
        print(f"{name}: {r['rows']} rows, {r['tokens'] / 1e6:.1f} M tokens, {r['skipped']} skipped; "
              f"RssAnon {r['rss_anon_mb']:.0f} MiB, RssFile {r['rss_file_mb']:.0f} MiB (mapped token files)")
    growth = (restart_large["rss_anon_mb"] - restart_small["rss_anon_mb"]) / ((a.large - a.small) / 1e5)
    print(f"tokenize_tokens_per_s: {first_small['build']:.0f}")
    print(f"tokenize_processes: {first_small['build_processes']}")
    print(f"first_start_s_small: {first_small['ready_s']:.2f}")
    print(f"restart_s_small: {restart_small['ready_s']:.2f}")
    print(f"first_start_s_large: {first_large['ready_s']:.2f}")
    print(f"restart_s_large: {restart_large['ready_s']:.2f}")
    print(f"restart_vs_first: {restart_small['ready_s'] / first_small['ready_s']:.3f}")
    print(f"trainer_rss_mb_small: {restart_small['rss_anon_mb']:.1f}")
    print(f"trainer_rss_mb_large: {restart_large['rss_anon_mb']:.1f}")
    print(f"rss_growth_per_100k_rows_mb: {growth:.1f}")
    print(f"pack_fill: {restart_small['fill']:.4f}")


def one_row_group(a) -> None:
    from specdistill.launch.tokenizer import save_tokenizer, workload_tokenizer

    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        root = Path(tmp)
        tok_dir = root / "tokenizer"
        tok_dir.mkdir()
        save_tokenizer(workload_tokenizer(), tok_dir)
        path = root / "one.parquet"
        t0 = time.perf_counter()
        write_chat_parquet_one_row_group(path, a.one_row_group, a.prompt_tokens)
        print(f"wrote {path} ({path.stat().st_size / 2**20:.0f} MiB, {a.one_row_group} rows, one row group) in "
              f"{time.perf_counter() - t0:.0f} s")
        r = start_once(path, tok_dir, root / "cache", walk=False, processes=a.processes)
    print(f"one_row_group: {r['rows']} rows, {r['tokens'] / 1e6:.1f} M tokens; first start {r['ready_s']:.1f} s")
    print(f"one_row_group_rows_per_s: {r['build_rows_per_s']:.1f}")
    print(f"one_row_group_tokens_per_s: {r['build']:.0f}")
    print(f"one_row_group_processes: {r['build_processes']}")


if __name__ == "__main__":
    main()
