"""Hand-off from vLLM to the ring (not a test): `python bench/vllm_handoff.py [--rows 12] [--tokens 300]`.

Per sample, one row per generate call (the feature server's batch_rows), on the committed target
specdistill/launch/assets/small-real (6-layer Llama, fp32 engine), layer ids 1..6 crossing in bf16:
  direct   VLLMBackend.publish into a ShmChannel: the engine's connector writes the states into the ring region
           the client reserved, during the prefill's own engine step; the client publishes it (what workers do now)
  file     the previous hand-off, rebuilt here (FileHandoffConnector = vLLM's ExampleHiddenStatesConnector with a
           synchronous CPU write): the engine saves one safetensors file per request on tmpfs in its *next* step;
           the client waits on the file's flock, loads it, deletes it, casts to bf16, then copies it into the ring
One engine at a time, the same rows. Each engine's connector also times its own gather + write (`*_engine_*`: the
engine is another process; it appends them to a file).
Then the host-side operations of both at the production sample size (--prod-tokens x 6 layers x 2048, bf16:
124 MB at 5,045 tokens), timed here, for the GPU-node arithmetic in docs/scaling.md ("Hand-off from vLLM").
Prints `name: value` lines last: per-sample milliseconds and the file hand-off's fraction of a sample's time.
"""

import argparse
import fcntl
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (  # noqa: E402
    ExampleHiddenStatesConnector, PendingSave, cleanup_hidden_states, extract_from_kv_cache,
)

from specdistill.core.contract import FeatureSpec, TokenizedRow  # noqa: E402
from specdistill.core.vllm_engine import target_text_config  # noqa: E402
from specdistill.feature_server.backends import sample_tensors  # noqa: E402
from specdistill.feature_server.shm_transport import RegionWriter, ShmChannel  # noqa: E402
from specdistill.feature_server.vllm_backend import (  # noqa: E402
    RingHiddenStatesConnector, VLLMBackend, extraction_engine_kwargs, shutdown_engine,
)

TARGET = "specdistill/launch/assets/small-real"
SPEC = FeatureSpec((1, 2, 3, 4, 5, 6), "bfloat16")  # 5 + 1 captured layers, as the production drafter asks
WARMUP = 2


class _Done:
    def query(self) -> bool:
        return True


def _record(connector, seconds: float) -> None:
    """Append one engine-side duration to the file the bench named (the engine is another process)."""
    with open(connector._kv_transfer_config.get_from_extra_config("timing_path", None), "a") as f:
        f.write(f"{seconds}\n")


class FileHandoffConnector(ExampleHiddenStatesConnector):
    """The previous connector (specdistill/feature_server/vllm_backend.py before the direct path): the stock per-request file,
    written synchronously on CPU in the step after the request finished. Times its gather + save."""

    def _submit_async_write(self, pending: PendingSave) -> None:
        t0 = time.perf_counter()
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (block_ids[:, None] * self._block_size + offsets[None, :]).flatten()
        hidden_TLD = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).to("cpu", copy=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        try:
            save_file({"hidden_states": hidden_TLD.contiguous(), "token_ids": pending.token_ids.clone()},
                      pending.filename)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)
        self._req_copy_events[pending.req_id] = _Done()
        _record(self, time.perf_counter() - t0)


class TimedRingConnector(RingHiddenStatesConnector):
    """The direct path's connector, timing its gather + cast + write into the ring region."""

    def _write(self, write) -> None:
        t0 = time.perf_counter()
        super()._write(write)
        _record(self, time.perf_counter() - t0)


def _connector_config(cls: type, timing_path: str, **extra) -> dict:
    return {"kv_connector": cls.__name__, "kv_connector_module_path": "bench.vllm_handoff", "kv_role": "kv_producer",
            "kv_connector_extra_config": {"timing_path": timing_path, **extra}}


def _engine_times(path: str) -> list[float]:
    with open(path) as f:
        return [float(line) for line in f]


def make_rows(n: int, tokens: int) -> list[TokenizedRow]:
    g = torch.Generator().manual_seed(0)
    return [TokenizedRow(i, tuple(torch.randint(1, 4096, (tokens,), generator=g).tolist()),
                         (0,) * (tokens - tokens // 6) + (1,) * (tokens // 6)) for i in range(n)]


def ms(values: list[float]) -> float:
    return 1e3 * statistics.median(values[WARMUP:])


def file_sample(llm, row: TokenizedRow, ch: ShmChannel) -> tuple[float, float, float, float]:
    """(generate, wait for the file, load + delete + check + cast, ring copy) seconds for one row."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    t0 = time.perf_counter()
    out = llm.generate([TokensPrompt(prompt_token_ids=list(row.input_ids))], params, use_tqdm=False)[0]
    t1 = time.perf_counter()
    path = out.kv_transfer_params["hidden_states_path"]
    with open(path + ".lock") as lock:  # load_hidden_states, split: the engine saves in its next step
        fcntl.flock(lock, fcntl.LOCK_SH)
        t2 = time.perf_counter()
        data = load_file(path)
    cleanup_hidden_states(path)
    assert data["token_ids"].tolist() == list(row.input_ids), f"row {row.row_id}: token ids differ"
    hidden_TLD = data["hidden_states"].to(SPEC.torch_dtype)  # load_file is lazy: this reads the file's pages
    t3 = time.perf_counter()
    ch.put(row.row_id, sample_tensors(row, hidden_TLD, SPEC))
    t4 = time.perf_counter()
    del ch.get(timeout=60).tensors
    return t1 - t0, t2 - t1, t3 - t2, t4 - t3


def direct_sample(backend: VLLMBackend, row: TokenizedRow, ch: ShmChannel, producer) -> float:
    t0 = time.perf_counter()
    backend.publish([row], producer, {})
    dt = time.perf_counter() - t0
    del ch.get(timeout=60).tensors
    return dt


def bench_paths(rows: list[TokenizedRow]) -> dict[str, float]:
    """One engine at a time (an idle engine still polls, which would slow the other one down): file, then direct."""
    from vllm import LLM

    max_len = max(r.num_tokens for r in rows) + 8
    scratch = tempfile.mkdtemp(prefix="bench-handoff-", dir="/dev/shm")
    file_times, direct_times = os.path.join(scratch, "file_engine.txt"), os.path.join(scratch, "direct_engine.txt")
    t = {"file_generate": [], "file_wait": [], "file_load_cast": [], "file_ring_copy": [], "direct_publish": []}
    with ShmChannel(64 << 20, producers=2, handle_signals=False) as ch:
        context = target_text_config(TARGET).max_position_embeddings  # both engines start at the same length
        kwargs = extraction_engine_kwargs(TARGET, SPEC.layer_ids, "float32", max_len, context=context)
        kwargs["kv_transfer_config"] = _connector_config(FileHandoffConnector, file_times, shared_storage_path=scratch)
        llm = LLM(**kwargs)
        try:
            for row in rows:
                for name, dt in zip(list(t)[:4], file_sample(llm, row, ch)):
                    t[name].append(dt)
        finally:
            shutdown_engine(llm)
        with VLLMBackend(TARGET, SPEC, device="cpu", max_model_len=max_len,
                         kv_transfer_config=_connector_config(TimedRingConnector, direct_times)) as backend:
            producer = ch.producer(1)
            for row in rows:
                t["direct_publish"].append(direct_sample(backend, row, ch, producer))
    out = {f"{name}_ms": ms(v) for name, v in t.items()}
    out["file_engine_save_ms"] = ms(_engine_times(file_times))
    out["direct_engine_write_ms"] = ms(_engine_times(direct_times))
    shutil.rmtree(scratch)
    return out


def bench_host_ops(tokens: int, reps: int) -> dict[str, float]:
    """The host-side work of each path for one production-size sample (engine dtype bf16, so no cast)."""
    hidden_TLD = torch.randn(tokens, 6, 2048).to(torch.bfloat16)
    row = TokenizedRow(0, tuple(range(tokens)), (1,) * tokens)
    t = {"file_save": [], "file_load_copy": [], "direct_write": []}
    directory = tempfile.mkdtemp(prefix="bench-handoff-", dir="/dev/shm")
    writer = RegionWriter()
    with ShmChannel(2 * hidden_TLD.numel() * 2 + (1 << 20), handle_signals=False) as ch:
        producer = ch.producer(0)
        for i in range(reps + WARMUP):
            path = os.path.join(directory, f"{i}.safetensors")
            t0 = time.perf_counter()
            save_file({"hidden_states": hidden_TLD, "token_ids": torch.arange(tokens)}, path)
            t1 = time.perf_counter()
            loaded = load_file(path)["hidden_states"]  # a lazy view of the file: the ring copy reads its pages
            os.unlink(path)
            producer.put(0, sample_tensors(row, loaded, SPEC))
            t3 = time.perf_counter()
            del ch.get(timeout=60).tensors, loaded
            res = producer.reserve(1, {"input_ids_T": (torch.int64, (tokens,)), "loss_mask_T": (torch.bool, (tokens,)),
                                       "hidden_TLD": (torch.bfloat16, tuple(hidden_TLD.shape))})
            t4 = time.perf_counter()
            writer.write(res.location, {"hidden_TLD": hidden_TLD, "input_ids_T": torch.arange(tokens)})
            t5 = time.perf_counter()
            producer.publish(res)
            del ch.get(timeout=60).tensors
            for name, dt in zip(t, (t1 - t0, t3 - t1, t5 - t4)):
                t[name].append(dt)
    os.rmdir(directory)
    return {f"prod_{name}_ms": ms(v) for name, v in t.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=12, help="timed rows per path (after 2 warm-up rows)")
    parser.add_argument("--tokens", type=int, default=300)
    parser.add_argument("--prod-tokens", type=int, default=5045)
    parser.add_argument("--prod-reps", type=int, default=5)
    args = parser.parse_args()
    os.chdir(Path(__file__).resolve().parents[1])
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    rows = make_rows(args.rows + WARMUP, args.tokens)
    r = {**bench_paths(rows), **bench_host_ops(args.prod_tokens, args.prod_reps)}
    handoff = r["file_wait_ms"] + r["file_load_cast_ms"] + r["file_ring_copy_ms"]
    file_total = r["file_generate_ms"] + handoff
    print(f"small-real, {args.rows} rows x {args.tokens} tokens, layers {list(SPEC.layer_ids)} -> bf16, one row per "
          f"generate; production-size host ops: {args.prod_tokens} tokens x 6 x 2048 bf16 "
          f"({args.prod_tokens * 6 * 2048 * 2 / 1e6:.0f} MB), {args.prod_reps} reps")
    for name, value in r.items():
        print(f"{name}: {value:.3f}")
    print(f"file_per_sample_ms: {file_total:.3f}")
    print(f"file_handoff_fraction: {handoff / file_total:.4f}")  # wait for the next step + load + ring copy
    print(f"direct_write_fraction: {r['direct_engine_write_ms'] / r['direct_publish_ms']:.4f}")
    print(f"direct_vs_file_per_sample: {r['direct_publish_ms'] / file_total:.3f}")


if __name__ == "__main__":
    main()
