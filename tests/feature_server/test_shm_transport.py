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

from specdistill.feature_server.shm_transport import (
    ChannelFull, LocalRegion, RegionWriter, ShmChannel, check_metadata_only, segment_paths, sweep_segments,
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
        assert segment_paths(ch.prefix) == []  # the ring is mapped on both sides: its name is gone
        assert ch.bytes_in_flight() == _layout_bytes(sent)  # views of the ring: still held
        del got
        assert ch.bytes_in_flight() == 0  # the last view gone -> the region is free


def _layout_bytes(tensors) -> int:
    from specdistill.feature_server.shm_transport import _layout
    return _layout(tensors)[1]


def test_held_views_are_never_overwritten_and_free_room_when_dropped():
    """Zero-copy: a held sample pins its ring region; the producer waits instead of overwriting it.
    The ring is FIFO, so room behind a held region comes back only when that region is dropped."""
    one = _layout_bytes({"x": torch.arange(64)})
    with ShmChannel(2 * one, prefix=_prefix()) as ch:
        ch.put(0, {"x": torch.arange(64)})
        held = ch.get(timeout=HANG_GUARD_S).tensors["x"][10:20]  # a slice keeps the region pinned too
        ch.put(1, {"x": torch.full((64,), 7)})
        assert ch.get(timeout=HANG_GUARD_S).key == 1  # dropped at once, but behind the held region
        with pytest.raises(ChannelFull):
            ch.put(2, {"x": torch.full((64,), 9)}, block=False)
        assert held.tolist() == list(range(10, 20))
        del held
        ch.put(2, {"x": torch.full((64,), 9)}, block=False)
        assert ch.get(timeout=HANG_GUARD_S).tensors["x"].tolist() == [9] * 64
        assert ch.bytes_in_flight() == 0


def test_ring_reuse_round_trips_many_payloads_exactly():
    with ShmChannel(3 * _layout_bytes(_payload()), prefix=_prefix()) as ch:
        for i in range(20):  # wraps the ring several times
            ch.put(i, _payload(i))
            got = ch.get(timeout=HANG_GUARD_S)
            assert got.key == i and all(torch.equal(got.tensors[k], v) for k, v in _payload(i).items())


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
        raw = [ch._readers[0].recv() for _ in range(2)]  # what actually crossed the control pipe
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
    assert len(segment_paths(ch.prefix)) == 1  # one ring holds both
    ch.close()
    assert segment_paths(ch.prefix) == []


def test_exception_inside_context_sweeps():
    with pytest.raises(RuntimeError, match="boom"):
        with ShmChannel(1 << 20, prefix=_prefix()) as ch:
            ch.put(0, _payload())
            raise RuntimeError("boom")
    assert segment_paths(ch.prefix) == []


def _produce_forever(producer) -> None:
    for i in range(10**9):
        producer.put(i, _payload(i))


def _put_one_and_exit(producer) -> None:
    producer.put(7, _payload())
    producer.close()


def test_a_dead_producers_ring_is_unmapped_once_its_last_sample_is_dropped():
    """The consumer maps each producer's ring; a producer that died must not keep its ring mapped for the rest of
    the run: it goes when release_producer is called and no sample of it is held (at once if none is)."""
    with ShmChannel(1 << 20, prefix=_prefix(), handle_signals=False, producers=2) as ch:
        for pid in (0, 1):
            p = mp.get_context("spawn").Process(target=_put_one_and_exit, args=(ch.producer(pid),))
            p.start()
            ch.started(pid)
            p.join(HANG_GUARD_S)
        held = [m for m in (ch.get(timeout=HANG_GUARD_S) for _ in range(4)) if m.kind == "data"]
        assert sorted(m.producer_id for m in held) == [0, 1] and ch.mapped_rings == 2
        ch.release_producer(0)
        assert ch.mapped_rings == 2  # producer 0's sample is still held: its ring stays mapped
        sample = next(m for m in held if m.producer_id == 0)
        assert torch.equal(sample.tensors["fp32"], _payload()["fp32"])  # and readable
        held = [m for m in held if m.producer_id != 0]
        del sample
        assert ch.mapped_rings == 1  # dropped with its last view
        held.clear()
        ch.release_producer(1)
        assert ch.mapped_rings == 0


def test_killed_producer_leftovers_swept_at_close_and_at_next_start():
    size = _one_payload_bytes()
    ch = ShmChannel(2 * size, prefix=_prefix())
    p = mp.get_context("spawn").Process(target=_produce_forever, args=(ch.producer(1),), daemon=True)
    p.start()
    ch.started(1)
    try:
        # Backpressure across processes: two payloads in flight, the producer waits for the third.
        _wait_until(lambda: ch.blocked_producers() == 1, "producer process blocked on capacity")
        assert len(segment_paths(ch.prefix)) == 1  # its ring, not yet mapped by the consumer
        os.kill(p.pid, signal.SIGKILL)
        p.join(HANG_GUARD_S)
        assert p.exitcode == -signal.SIGKILL
        # A producer killed while waiting must not hang the consumer (a multiprocessing.Condition would).
        got = ch.get(timeout=HANG_GUARD_S)
        assert got.key == 0 and torch.equal(got.tensors["fp32"], _payload(0)["fp32"])
        assert ch.get(timeout=HANG_GUARD_S).key == 1  # delivered before the kill: still readable
        assert ch.get(timeout=HANG_GUARD_S).kind == "eof"  # then its stream ends: no hang, no guessing
        assert segment_paths(ch.prefix) == []  # mapped -> unlinked: the dead producer's ring cannot leak
        # A crash before the consumer mapped anything: a restart with the same prefix sweeps it,
        open(os.path.join("/dev/shm", f"{ch.prefix}-ring1-{p.pid}"), "wb").close()
        ShmChannel(1, prefix=ch.prefix, handle_signals=False).close()
        assert segment_paths(ch.prefix) == []
        # and so does close(), for whatever is there at that point.
        open(os.path.join("/dev/shm", f"{ch.prefix}-1-{p.pid}-99"), "wb").close()
    finally:
        ch.close()
    assert segment_paths(ch.prefix) == []


_CONSUMER_SCRIPT = textwrap.dedent("""
    import signal, sys, torch
    from specdistill.feature_server.shm_transport import ShmChannel
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
        assert len(segment_paths(prefix)) == 1
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


def test_files_are_private_to_the_user():
    with ShmChannel(1 << 20, prefix=_prefix()) as ch:
        ch.put(0, _payload())  # a ring, not yet mapped by the consumer
        ring = segment_paths(ch.prefix)
        ch2 = ShmChannel(1, prefix=_prefix())  # 1 byte: every payload takes the oversized path
        ch2.put(0, _payload())
        oversized = segment_paths(ch2.prefix)
        modes = [os.stat(path).st_mode & 0o777 for path in ring + oversized]
        ch2.close()
    assert len(modes) == 2 and modes == [0o600, 0o600]


# ---- writes in place: reserve, write (here or in another process), publish -----------------------------------------
_SAMPLE_LAYOUT = {"input_ids_T": (torch.int64, (5,)), "loss_mask_T": (torch.bool, (5,)),
                  "hidden_TLD": (torch.bfloat16, (5, 3, 16))}


def _write_from_another_process(location: dict, hidden_fp32, ids) -> None:
    RegionWriter().write(location, {"hidden_TLD": hidden_fp32, "input_ids_T": ids})


def _write_in_child(location: dict, hidden_fp32, ids) -> None:
    p = mp.get_context("spawn").Process(target=_write_from_another_process, args=(location, hidden_fp32, ids))
    p.start()
    p.join(HANG_GUARD_S)
    assert p.exitcode == 0


def test_reserved_region_written_by_another_process_after_the_name_is_gone_is_published_without_a_copy():
    hidden = torch.randn(5, 3, 16)
    ids = torch.arange(10, 15)
    with ShmChannel(1 << 20, prefix=_prefix()) as ch:
        ch.put(0, _payload())  # the consumer maps the ring with its first payload, then unlinks its name
        del ch.get(timeout=HANG_GUARD_S).tensors
        assert segment_paths(ch.prefix) == []
        res = ch.reserve(1, _SAMPLE_LAYOUT)
        assert ch.bytes_in_flight() == res.nbytes  # reserved counts against capacity before it is published
        res.tensors["loss_mask_T"].copy_(torch.tensor([0, 0, 1, 1, 1], dtype=torch.bool))
        _write_in_child(res.location, hidden, ids)  # through /proc/<pid>/fd: the ring has no name any more
        ch.publish(res, info={"stream": 3})
        got = ch.get(timeout=HANG_GUARD_S)
        assert (got.kind, got.key, got.info) == ("data", 1, {"stream": 3})
        assert got.tensors["hidden_TLD"].dtype == torch.bfloat16
        assert torch.equal(got.tensors["hidden_TLD"], hidden.to(torch.bfloat16))  # cast on write
        assert torch.equal(got.tensors["input_ids_T"], ids)
        assert got.tensors["loss_mask_T"].tolist() == [False, False, True, True, True]
        del got
        assert ch.bytes_in_flight() == 0
    assert segment_paths(ch.prefix) == []


def test_oversized_reservation_is_written_in_place_and_swept_if_never_published():
    hidden = torch.randn(5, 3, 16)
    with ShmChannel(1, prefix=_prefix()) as ch:  # 1 byte: every payload takes the oversized path
        res = ch.reserve(4, _SAMPLE_LAYOUT)
        assert len(segment_paths(ch.prefix)) == 1
        _write_in_child(res.location, hidden, torch.arange(5))
        ch.publish(res)
        got = ch.get(timeout=HANG_GUARD_S)
        assert torch.equal(got.tensors["hidden_TLD"], hidden.to(torch.bfloat16))
        assert segment_paths(ch.prefix) == []  # read and unlinked
        ch.reserve(5, _SAMPLE_LAYOUT)  # a producer that dies (or fails) before publishing leaves a named file
        assert len(segment_paths(ch.prefix)) == 1
    assert segment_paths(ch.prefix) == []  # which the owner's sweep removes


def test_ring_reservations_publish_in_order_and_unpublished_ones_are_skipped():
    size = _layout_bytes({"x": torch.zeros(64)})
    with ShmChannel(3 * size, prefix=_prefix()) as ch:
        a, b, c = (ch.reserve(i, {"x": (torch.float32, (64,))}) for i in range(3))
        with pytest.raises(ChannelFull, match="not published leave no room"):  # waiting could never end
            ch.reserve(3, {"x": (torch.float32, (64,))}, timeout=HANG_GUARD_S)
        b.tensors["x"].fill_(2.0)
        ch.publish(b)  # a is never published: skipped
        with pytest.raises(ValueError, match="order they were made"):
            ch.publish(a)
        with pytest.raises(ValueError, match="already published"):
            ch.publish(b)
        got = ch.get(timeout=HANG_GUARD_S)
        assert got.key == 1 and bool((got.tensors["x"] == 2.0).all())
        del got
        assert ch.bytes_in_flight() == size  # c: reserved, still held; a's room came back with b's
        c.tensors["x"].fill_(3.0)
        ch.publish(c)
        del ch.get(timeout=HANG_GUARD_S).tensors
        assert ch.bytes_in_flight() == 0


def test_region_writer_names_the_row_and_field_it_cannot_write():
    region = LocalRegion(9, _SAMPLE_LAYOUT)
    writer = RegionWriter()
    try:
        with pytest.raises(ValueError, match=r"row 9: field 'hidden_TLD' got shape \(4, 3, 16\)"):
            writer.write(region.location, {"hidden_TLD": torch.zeros(4, 3, 16)})
        with pytest.raises(KeyError, match="row 9: fields \\['logits'\\]"):
            writer.write(region.location, {"logits": torch.zeros(1)})
        with pytest.raises(RuntimeError, match="row 9: .* not the producer's region file"):
            writer.write({**region.location, "inode": region.location["inode"] + 1}, {"input_ids_T": torch.ones(5)})
        writer.write(region.location, {"input_ids_T": torch.arange(5)})  # a LocalRegion: written through /proc too
        assert region.tensors["input_ids_T"].tolist() == [0, 1, 2, 3, 4]
    finally:
        region.close()
    # Closed: the writer is too late. The fd number is gone, or already names another file (the inode says so).
    with pytest.raises(RuntimeError, match="row 9: (cannot open its region file|.* not the producer's region file)"):
        RegionWriter().write(region.location, {"input_ids_T": torch.arange(5)})
