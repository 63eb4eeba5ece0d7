"""ShmChannel: round trips, backpressure, metadata-only control path, and that no /dev/shm segment survives."""

import multiprocessing as mp
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid

import pytest
import torch

from feature_server.shm_transport import (
    ChannelFull, ShmChannel, check_metadata_only, segment_paths, sweep_segments,
)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HANG_GUARD_S = 60  # only bounds a hang; no test asserts how long anything took


def _prefix() -> str:
    return f"sdtest_{uuid.uuid4().hex[:10]}"


def _payload(n: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    return {
        "hidden_TLD": torch.randn(5, 3, 16, generator=g).to(torch.bfloat16),
        "fp32": torch.randn(7, generator=g),
        "input_ids_T": torch.randint(0, 1000, (5,), generator=g),
        "loss_mask_T": torch.rand(5, generator=g) > 0.5,
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
    }


def _wait_until(cond, what: str):
    deadline = time.monotonic() + HANG_GUARD_S
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for: {what}")
        time.sleep(0.01)


def _one_payload_bytes() -> int:
    with ShmChannel(1 << 30, prefix=_prefix(), handle_signals=False) as ch:
        ch.put(0, _payload())
        size = ch.bytes_in_flight()
    return size


def test_round_trip_all_dtypes_and_segment_gone_after_get():
    with ShmChannel(1 << 20, prefix=_prefix()) as ch:
        sent = _payload()
        ch.put(42, sent, producer_id=3, info={"extract_s": 0.5})
        assert len(segment_paths(ch.prefix)) == 1
        got = ch.get(timeout=HANG_GUARD_S)
        assert (got.kind, got.key, got.producer_id, got.info) == ("data", 42, 3, {"extract_s": 0.5})
        assert set(got.tensors) == set(sent)
        for name, t in sent.items():
            assert got.tensors[name].dtype == t.dtype, name
            assert got.tensors[name].shape == t.shape, name
            assert torch.equal(got.tensors[name], t), name
        assert segment_paths(ch.prefix) == []
        assert ch.bytes_in_flight() == 0


def test_received_tensors_are_private_copies():
    with ShmChannel(1 << 20, prefix=_prefix()) as ch:
        ch.put(0, {"x": torch.arange(4)})
        got = ch.get(timeout=HANG_GUARD_S).tensors["x"]
        got += 1  # writable, and the segment is already unlinked
        assert got.tolist() == [1, 2, 3, 4]


def test_nonblocking_put_refused_until_consumer_releases():
    size = _one_payload_bytes()
    with ShmChannel(size, prefix=_prefix()) as ch:
        ch.put(0, _payload())
        with pytest.raises(ChannelFull):
            ch.put(1, _payload(), block=False)
        assert len(segment_paths(ch.prefix)) == 1  # the refused payload wrote nothing
        ch.get(timeout=HANG_GUARD_S)
        ch.put(1, _payload(), block=False)
        assert ch.get(timeout=HANG_GUARD_S).key == 1


def test_oversized_payload_moves_when_nothing_in_flight():
    with ShmChannel(1, prefix=_prefix()) as ch:
        ch.put(0, _payload())  # far larger than 1 byte, but the channel is empty
        with pytest.raises(ChannelFull):
            ch.put(1, _payload(), block=False)
        assert ch.get(timeout=HANG_GUARD_S).key == 0


def test_blocked_producer_resumes_only_after_get():
    size = _one_payload_bytes()
    with ShmChannel(size, prefix=_prefix()) as ch:
        released = threading.Event()
        put_returned_after_release = []

        def produce():
            ch.put(0, _payload(0))
            ch.put(1, _payload(1))  # must wait for the consumer
            put_returned_after_release.append(released.is_set())

        t = threading.Thread(target=produce)
        t.start()
        _wait_until(lambda: ch.blocked_producers() == 1, "producer blocked on capacity")
        assert len(segment_paths(ch.prefix)) == 1 and ch.bytes_in_flight() == size
        released.set()
        assert ch.get(timeout=HANG_GUARD_S).key == 0
        t.join(HANG_GUARD_S)
        assert put_returned_after_release == [True]
        assert ch.get(timeout=HANG_GUARD_S).key == 1


def test_control_queue_carries_metadata_only():
    with ShmChannel(1 << 24, prefix=_prefix()) as ch:
        big = {"hidden_TLD": torch.randn(256, 4, 256).to(torch.bfloat16)}  # 512 KiB
        ch.put(7, big, info={"extract_s": 0.1})
        ch.send("done", producer_id=0, info={"samples": 1})
        raw = [ch._control.get(timeout=HANG_GUARD_S) for _ in range(2)]  # what actually crossed the queue
        for msg in raw:
            check_metadata_only(msg)
            assert len(pickle.dumps(msg)) < 4096
        assert raw[0]["fields"][0]["shape"] == (256, 4, 256)
        with pytest.raises(TypeError, match="not allowed on the control path"):
            ch.put(8, big, info={"oops": torch.zeros(1)})
        with pytest.raises(TypeError, match="not allowed on the control path"):
            ch.send("error", info={"oops": torch.zeros(1)})
        with pytest.raises(TypeError):
            check_metadata_only({"a": [1, (2, b"bytes")]})
    assert segment_paths(ch.prefix) == []  # the raw-read segment was swept at close


def test_close_sweeps_unconsumed_segments():
    ch = ShmChannel(1 << 20, prefix=_prefix())
    ch.put(0, _payload())
    ch.put(1, _payload())
    assert len(segment_paths(ch.prefix)) == 2
    ch.close()
    assert segment_paths(ch.prefix) == []


def test_exception_inside_context_sweeps():
    with pytest.raises(RuntimeError, match="boom"):
        with ShmChannel(1 << 20, prefix=_prefix()) as ch:
            ch.put(0, _payload())
            raise RuntimeError("boom")
    assert segment_paths(ch.prefix) == []


def _produce_forever(ch: ShmChannel) -> None:
    for i in range(10**9):
        ch.put(i, _payload(i), producer_id=1)


def test_killed_producer_leftovers_swept_at_close_and_at_next_start():
    size = _one_payload_bytes()
    ch = ShmChannel(2 * size, prefix=_prefix())
    p = mp.get_context("spawn").Process(target=_produce_forever, args=(ch,), daemon=True)
    p.start()
    try:
        # Backpressure across processes: two payloads in flight, the producer waits for the third.
        _wait_until(lambda: ch.blocked_producers() == 1, "producer process blocked on capacity")
        assert len(segment_paths(ch.prefix)) == 2
        os.kill(p.pid, signal.SIGKILL)
        p.join(HANG_GUARD_S)
        assert p.exitcode == -signal.SIGKILL
        # A producer killed while waiting must not hang the consumer (a multiprocessing.Condition would).
        got = ch.get(timeout=HANG_GUARD_S)
        assert got.key == 0 and torch.equal(got.tensors["fp32"], _payload(0)["fp32"])
        assert len(segment_paths(ch.prefix)) == 1  # the crash left the unread one behind...
        # ...a restart with the same prefix sweeps it,
        ShmChannel(1, prefix=ch.prefix, handle_signals=False).close()
        assert segment_paths(ch.prefix) == []
        # and so does close(), for whatever is there at that point.
        open(os.path.join("/dev/shm", f"{ch.prefix}-1-{p.pid}-99"), "wb").close()
    finally:
        ch.close()
    assert segment_paths(ch.prefix) == []


_CONSUMER_SCRIPT = textwrap.dedent("""
    import signal, sys, torch
    from feature_server.shm_transport import ShmChannel
    ch = ShmChannel(1 << 20, prefix=sys.argv[1])
    ch.put(0, {"x": torch.zeros(100)})
    ch.put(1, {"x": torch.ones(100)})
    print("ready", flush=True)
    while True:
        signal.pause()
""")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_consumer_signal_sweeps_segments(signum):
    prefix = _prefix()
    proc = subprocess.Popen([sys.executable, "-c", _CONSUMER_SCRIPT, prefix], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
        assert len(segment_paths(prefix)) == 2
        proc.send_signal(signum)
        proc.wait(HANG_GUARD_S)
    finally:
        proc.kill()
        sweep_segments(prefix)  # never leak from the test itself, even when it fails
    assert proc.returncode != 0  # the signal still ends the process
    assert segment_paths(prefix) == []


def test_prefix_validation():
    with pytest.raises(ValueError, match="no '-'"):
        ShmChannel(1, prefix="run-1")
