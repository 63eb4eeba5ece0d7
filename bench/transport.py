"""Hidden-state transport benchmark (not a test): `python bench/transport.py [--tokens 5000] [--samples 12]`.

One producer process streams samples of a realistic shape (T tokens x 5 layers x hidden 2048, bf16: ~100 MB at
5k tokens) to this process, which takes each one and reads every byte of it: it copies the sample into a
pre-touched sink buffer (what the trainer's packing does), then drops it. Compared, in this process:
  memcpy       one single-threaded copy of the same bytes from a warm source into the same pre-touched sink (the
               physical limit of one consumer core; no page faults are timed)
  shm          specdistill.feature_server.shm_transport.ShmChannel (the project's transport: the producer's one copy into a
               warm ring, zero-copy views on the consumer side, then the consumer's sink copy)
  file_backend speculators' hs_connectors file backend: the producer writes a safetensors file (on tmpfs, its
               best case), the consumer reads it with FileTransfer.get_generated, copies it to the sink, deletes it
Throughput is bytes / wall time from the first to the last sample taken (the first WARMUP are warm-up).
Prints GB/s per path, then last: `shm_vs_memcpy: R` and `shm_vs_file_backend: R` (best of --reps runs each).
"""

import argparse
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from specdistill.feature_server.shm_transport import ShmChannel  # noqa: E402

WARMUP = 4  # > the 3 samples a ring holds: every ring page has been touched once (first-touch faults excluded)


def _sample(tokens: int, layers: int, hidden: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"hidden_TLD": torch.randn(tokens, layers, hidden, generator=g).to(torch.bfloat16),
            "input_ids_T": torch.randint(0, 150_000, (tokens,), generator=g),
            "loss_mask_T": torch.zeros(tokens, dtype=torch.bool)}


def _nbytes(sample: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in sample.values())


def make_sink(sample) -> dict[str, torch.Tensor]:
    """A byte buffer per tensor, written once so that no timed copy takes a page fault."""
    sink = {k: torch.empty(t.numel() * t.element_size(), dtype=torch.uint8) for k, t in sample.items()}
    for buf in sink.values():
        buf.fill_(0)
    return sink


def consume(tensors: dict[str, torch.Tensor], sink: dict[str, torch.Tensor]) -> None:
    """Read every byte of a received sample: copy it into the sink."""
    for k, t in tensors.items():
        sink[k].copy_(t.reshape(-1).view(torch.uint8))


def bench_memcpy(sample, n: int) -> float:
    sink = make_sink(sample)
    consume(sample, sink)  # source and sink both warm
    t0 = time.perf_counter()
    for _ in range(n):
        consume(sample, sink)
    return _nbytes(sample) * n / (time.perf_counter() - t0)


def _shm_producer(producer, shape, n):
    torch.set_num_threads(1)
    sample = _sample(*shape)
    for i in range(n):
        producer.put(i, sample)
    producer.send("done")
    producer.close()


def bench_shm(sample, shape, n: int) -> float:
    ctx = mp.get_context("spawn")
    sink = make_sink(sample)
    with ShmChannel(3 * _nbytes(sample) + 4096, ctx=ctx) as ch:
        p = ctx.Process(target=_shm_producer, args=(ch.producer(0), shape, n + WARMUP))
        p.start()
        ch.started(0)
        t0 = None
        for i in range(n + WARMUP):
            msg = ch.get(timeout=300)
            assert msg.kind == "data" and msg.tensors["hidden_TLD"].shape == sample["hidden_TLD"].shape
            consume(msg.tensors, sink)
            del msg
            if i == WARMUP - 1:
                t0 = time.perf_counter()
        dt = time.perf_counter() - t0
        p.join()
    return _nbytes(sample) * n / dt


def _file_producer(directory, paths, shape, n):
    from safetensors.torch import save_file

    torch.set_num_threads(1)
    sample = _sample(*shape)
    for i in range(n):
        path = os.path.join(directory, f"hs_{i}.safetensors")
        save_file(sample, path)
        paths.put(path)
    paths.put(None)


def bench_file_backend(sample, shape, n: int) -> float:
    from hs_connectors import FileTransfer

    ctx = mp.get_context("spawn")
    sink = make_sink(sample)
    directory = tempfile.mkdtemp(prefix="bench-hs-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    transfer = FileTransfer(Path(directory))
    paths = ctx.Queue(maxsize=2)  # the same bound as the ring: at most ~3 samples in memory
    p = ctx.Process(target=_file_producer, args=(directory, paths, shape, n + WARMUP))
    p.start()
    try:
        t0 = None
        for i in range(n + WARMUP):
            path = paths.get(timeout=300)
            got = transfer.get_generated({"hidden_states_path": path})
            assert got["hidden_TLD"].shape == sample["hidden_TLD"].shape
            consume(got, sink)
            transfer.delete(path)
            del got
            if i == WARMUP - 1:
                t0 = time.perf_counter()
        dt = time.perf_counter() - t0
        p.join()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return _nbytes(sample) * n / dt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=5000)
    parser.add_argument("--layers", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--samples", type=int, default=12)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    shape = (args.tokens, args.layers, args.hidden)
    sample = _sample(*shape)
    print(f"sample: {args.tokens} tokens x {args.layers} layers x {args.hidden} hidden bf16 = "
          f"{_nbytes(sample) / 1e6:.1f} MB; {args.samples} samples per run, best of {args.reps}")
    best = {"memcpy": 0.0, "shm": 0.0, "file_backend": 0.0}
    for _ in range(args.reps):  # interleaved, so a busy spell on the machine hits every path alike
        best["memcpy"] = max(best["memcpy"], bench_memcpy(sample, args.samples))
        best["shm"] = max(best["shm"], bench_shm(sample, shape, args.samples))
        best["file_backend"] = max(best["file_backend"], bench_file_backend(sample, shape, args.samples))
    for name, rate in best.items():
        print(f"{name}_GBps: {rate / 1e9:.2f}")
    print(f"shm_vs_memcpy: {best['shm'] / best['memcpy']:.3f}")
    print(f"shm_vs_file_backend: {best['shm'] / best['file_backend']:.3f}")


if __name__ == "__main__":
    main()
