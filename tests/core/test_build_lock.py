"""One builder per cache entry (specdistill/core/build_lock.py), with flock and with the owner-file fallback used
where flock is unsupported: a second process is refused (naming the holder) or waits, a holder killed with -9 never
blocks the next one, a holder on another node that stops its heartbeat is taken over, scratch names never
collide, and publishing a build never removes a complete entry."""

import errno
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

import specdistill.core.build_lock as build_lock_module
from specdistill.core.build_lock import (LockHeld, build_lock, dead_scratch, owner_path, publish_dir,
                                         scratch_name)
from tests.cli import REPO

HOLD = """
import sys, time
from specdistill.core.build_lock import build_lock
with build_lock(sys.argv[1], what="writing"):
    print("held", flush=True)
    time.sleep(600)
"""


@pytest.mark.parametrize("mode", ["flock", "file"])
def test_a_held_lock_refuses_or_waits_and_a_killed_holder_never_blocks(mode, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDISTILL_LOCK", mode)
    entry = tmp_path / "out.jsonl"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(entry)], stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(LockHeld, match=rf"out.jsonl: another process is writing it \(host .*, pid {holder.pid}, "):
            with build_lock(entry, wait=False, what="writing"):
                pass
        got = threading.Event()

        def waiter():
            with build_lock(entry):
                got.set()

        t = threading.Thread(target=waiter)
        t.start()
        time.sleep(0.3)
        assert not got.is_set()  # waits for the holder
        os.kill(holder.pid, signal.SIGKILL)  # no cleanup: the kernel drops a flock, a dead pid's owner file is stale
        holder.wait()
        t.join(timeout=10)
        assert got.is_set()
    finally:
        holder.kill()
        holder.wait()
    assert not owner_path(entry).exists()  # the waiter released it


def test_auto_falls_back_to_the_owner_file_where_flock_is_unsupported(tmp_path, monkeypatch):
    def no_flock(*args):
        raise OSError(errno.ENOLCK, "No locks available")  # NFS without a lock manager

    monkeypatch.setattr(build_lock_module.fcntl, "flock", no_flock)
    entry = tmp_path / "store"
    with build_lock(entry):
        owner = json.loads(owner_path(entry).read_text())
        assert owner["pid"] == os.getpid()
        with pytest.raises(LockHeld, match=f"pid {os.getpid()}"):
            with build_lock(entry, wait=False):
                pass
    assert not owner_path(entry).exists()
    monkeypatch.setenv("SPECDISTILL_LOCK", "flock")
    with pytest.raises(OSError, match="SPECDISTILL_LOCK=file"):
        with build_lock(entry):
            pass


def test_an_owner_on_another_node_whose_heartbeat_stopped_is_taken_over(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDISTILL_LOCK", "file")
    monkeypatch.setenv("SPECDISTILL_LOCK_STALE_S", "2")
    entry = tmp_path / "store"
    path = owner_path(entry)
    path.write_text(json.dumps({"host": "other-node", "pid": 1, "since": 0, "token": "x"}))
    with pytest.raises(LockHeld, match="host other-node, pid 1"):  # a fresh heartbeat: alive
        with build_lock(entry, wait=False):
            pass
    old = time.time() - 5
    os.utime(path, (old, old))  # its last heartbeat 5 s ago (the filesystem's clock), the limit 2 s: stale
    with build_lock(entry, wait=False):
        assert json.loads(path.read_text())["host"] != "other-node"
    assert not path.exists()


def test_scratch_names_are_unique_per_host_process_and_call(tmp_path):
    a, b = scratch_name(tmp_path / "key"), scratch_name(tmp_path / "key")
    assert a != b and a.parent == tmp_path and a.name.startswith(".key.building-")
    assert f"-{os.getpid()}-" in a.name
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = tmp_path / a.name.replace(f"-{os.getpid()}-", f"-{gone.stdout.strip()}-")
    other_host = tmp_path / ".key.building-another-node-1-abcd"
    for p in (a, dead, other_host):
        p.mkdir()
    assert dead_scratch(tmp_path / "key") == [dead]  # a live process's and another host's stay


def test_a_build_is_published_by_rename_and_never_replaces_a_complete_entry(tmp_path):
    def complete(d):
        return (d / "meta.json").is_file()

    def built(text):
        tmp = scratch_name(tmp_path / "entry")
        tmp.mkdir()
        (tmp / "data").write_text(text)
        (tmp / "meta.json").write_text("{}")
        return tmp

    final = tmp_path / "entry"
    final.mkdir()
    (final / "data").write_text("half")  # a crashed in-place build of an older layout: no meta.json
    first = built("first")
    assert publish_dir(first, final, complete) and not first.exists() and (final / "data").read_text() == "first"
    second = built("second")  # a builder on another node got past the lock: the first stays, the second is dropped
    assert not publish_dir(second, final, complete) and (final / "data").read_text() == "first" and second.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["entry", second.name])  # the leftover removed
