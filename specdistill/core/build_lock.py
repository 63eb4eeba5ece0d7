"""One builder per cache entry, and one writer per output, on a local disk or a shared filesystem (NFS, Lustre).

Processes that need the same tiny target, workload or token store at once (a test session's parallel workers, the
ranks of a node, the nodes of a job sharing a cache) wait for the first builder instead of building it again. The
lock only saves work: a builder writes into a temporary directory of its own (`scratch_name`: host, pid and a random
part, so two nodes never share one) and publishes it with one rename, so even two builders that both got past the
lock leave one complete entry, and the loser reads the winner's (specdistill/data/token_store.py).

Two mechanisms (`SPECDISTILL_LOCK=auto|flock|file`):
  flock  an exclusive flock on `.<entry>.lock` beside the entry. The kernel (or the NFS lock manager) drops it when
         its holder exits, kill -9 included. The lock file stays (removing it would let a waiter lock an unlinked
         file); the holder writes its host and pid into it, for the messages of those refused.
  file   the fallback where flock is not supported (`auto` switches to it on ENOLCK, ENOSYS, EOPNOTSUPP: NFS without
         a lock manager, Lustre mounted `-o noflock`): `.<entry>.lock.owner` created with O_EXCL (atomic on NFSv3+
         and Lustre), holding the owner's host, pid and a token. A thread of the holder touches it every
         HEARTBEAT_S; a waiter takes the lock over when the owner is a dead process of its own host, or when the
         file's mtime is older than SPECDISTILL_LOCK_STALE_S seconds (default 120: more than a heartbeat plus NFS's
         attribute cache, at most 60 s) by the filesystem's clock (the mtime of a probe file the waiter touches:
         on NFS both times are the server's, so skewed node clocks do not matter). A takeover renames the stale
         file away first, so of several waiters only one takes it.
Set SPECDISTILL_LOCK=file where flock works on each node but not across nodes (Lustre `-o localflock`): flock would
let one builder per node through (correct, thanks to the rename, but each node builds).
"""

import errno
import fcntl
import glob
import json
import logging
import os
import secrets
import shutil
import socket
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager, suppress
from pathlib import Path

log = logging.getLogger(__name__)

LOCK_MODES = ("auto", "flock", "file")
HEARTBEAT_S = 10.0
STALE_S = 120.0  # SPECDISTILL_LOCK_STALE_S
_POLL_S = 0.5
_NO_FLOCK = {errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP}


class LockHeld(RuntimeError):
    """`build_lock(..., wait=False)` found the lock held; the message names the holder."""


def lock_path(entry: Path) -> Path:
    return entry.parent / f".{entry.name}.lock"


def owner_path(entry: Path) -> Path:
    return entry.parent / f".{entry.name}.lock.owner"


def scratch_name(entry: Path, what: str = "building") -> Path:
    """A temporary path beside `entry` that no other process or node uses: `.<name>.<what>-<host>-<pid>-<random>`."""
    return entry.parent / f".{entry.name}.{what}-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"


def dead_scratch(entry: Path, what: str = "building") -> list[Path]:
    """scratch_name paths beside `entry` left by processes of this host that are gone (a crashed builder's); those
    of other hosts are left alone (their processes cannot be checked from here)."""
    prefix = f".{entry.name}.{what}-{socket.gethostname()}-"
    out = []
    for path in entry.parent.glob(glob.escape(prefix) + "*"):
        pid = path.name[len(prefix):].split("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            out.append(path)
    return out


def publish_dir(tmp: Path, final: Path, is_complete: Callable[[Path], bool]) -> bool:
    """Rename the directory built in `tmp` into place as `final`. A complete entry already there (a builder on another
    node got past the lock) is kept and tmp left to the caller to remove (returns False); an incomplete leftover (an
    older layout, a crash's partial copy) is moved aside and removed. A complete entry is never removed, so readers
    that found it complete without the lock stay safe."""
    if is_complete(final):
        log.info("%s: built meanwhile by another process; using it", final)
        return False
    if final.exists():
        aside = scratch_name(final, "incomplete")
        with suppress(FileNotFoundError):
            os.rename(final, aside)
            if is_complete(aside):  # published between the check and the rename: put it back
                with suppress(OSError):
                    os.rename(aside, final)
                return False
            shutil.rmtree(aside, ignore_errors=True)
    try:
        os.rename(tmp, final)
    except OSError as e:
        if e.errno in (errno.ENOTEMPTY, errno.EEXIST) and is_complete(final):
            log.info("%s: built meanwhile by another process; using it", final)
            return False
        raise
    return True


def lock_mode() -> str:
    mode = os.environ.get("SPECDISTILL_LOCK", "auto")
    if mode not in LOCK_MODES:
        raise ValueError(f"SPECDISTILL_LOCK={mode!r}; valid: {', '.join(LOCK_MODES)}")
    return mode


@contextmanager
def build_lock(entry: str | Path, wait: bool = True, what: str = "building"):
    """Hold the lock of `entry` for the block. wait=False raises LockHeld (naming the holder) instead of waiting.
    `what` says in the log and in LockHeld what the holder is doing."""
    entry = Path(entry)
    entry.parent.mkdir(parents=True, exist_ok=True)
    if lock_mode() != "file":
        with open(lock_path(entry), "a+") as f:  # closing the file releases the lock
            if _flock(f, entry, wait, what):
                _write_owner(f, what)
                yield
                return
            if lock_mode() == "flock":
                raise OSError(errno.ENOLCK, f"{lock_path(entry)}: flock is not supported on this filesystem; "
                              "set SPECDISTILL_LOCK=file (or auto)")
            log.warning("%s: flock is not supported on this filesystem; using an O_EXCL owner file with a heartbeat "
                        "instead (specdistill/core/build_lock.py)", lock_path(entry))
    with _file_lock(entry, wait, what):
        yield


def _flock(f, entry: Path, wait: bool, what: str) -> bool:
    """True once locked; False where flock is unsupported."""
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        if not wait:
            f.seek(0)
            raise LockHeld(f"{entry}: another process is {what} it ({_describe(f.read())})") from None
        log.info("waiting for another process %s %s", what, entry)
        fcntl.flock(f, fcntl.LOCK_EX)
        return True
    except OSError as e:
        if e.errno in _NO_FLOCK:
            return False
        raise


def _owner_record(what: str) -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(), "what": what, "since": round(time.time()),
            "token": secrets.token_hex(8)}


def _write_owner(f, what: str) -> None:
    f.seek(0)
    f.truncate()
    f.write(json.dumps(_owner_record(what)))
    f.flush()


def _describe(text: str) -> str:
    try:
        o = json.loads(text)
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(o["since"]))
        return f"host {o['host']}, pid {o['pid']}, since {since}"
    except (ValueError, KeyError, TypeError):
        return "owner unknown"


# ---- the fallback: an O_EXCL owner file with a heartbeat -------------------------------------------------------
@contextmanager
def _file_lock(entry: Path, wait: bool, what: str):
    path, me = owner_path(entry), _owner_record(what)
    logged = False
    while True:
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            break
        except FileExistsError:
            pass
        holder = _read(path)
        if _stale(path, holder):
            _take_over(path, holder)
            continue
        if not wait:
            raise LockHeld(f"{entry}: another process is {what} it ({_describe(holder)})")
        if not logged:
            log.info("waiting for another process %s %s (%s)", what, entry, _describe(holder))
            logged = True
        time.sleep(_POLL_S)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(me))
    stop = threading.Event()
    beat = threading.Thread(target=_heartbeat, args=(path, stop), daemon=True, name=f"lock-heartbeat {entry.name}")
    beat.start()
    try:
        yield
    finally:
        stop.set()
        beat.join()
        if _token(_read(path)) == me["token"]:  # still ours (not taken over while this process was stopped)
            path.unlink(missing_ok=True)


def _heartbeat(path: Path, stop: threading.Event) -> None:
    while not stop.wait(HEARTBEAT_S):
        try:
            os.utime(path)  # NFS sets the server's time: waiters compare mtimes with each other only
        except OSError:
            pass


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _token(text: str) -> str | None:
    try:
        return json.loads(text).get("token")
    except (ValueError, AttributeError):
        return None


def _stale(path: Path, holder: str) -> bool:
    """The owner is a dead process of this host, or its heartbeat is older than SPECDISTILL_LOCK_STALE_S by the
    filesystem's own clock (a probe file's mtime: on NFS the server's, as the heartbeat's; no clock skew)."""
    try:
        owner = json.loads(holder)
        if owner["host"] == socket.gethostname() and not _alive(int(owner["pid"])):
            return True
    except (ValueError, KeyError, TypeError):
        pass  # being written, or unreadable: judged by its heartbeat
    try:
        beat = path.stat().st_mtime_ns
    except FileNotFoundError:
        return False  # released meanwhile: try again
    return _fs_now(path.parent) - beat > float(os.environ.get("SPECDISTILL_LOCK_STALE_S", STALE_S)) * 1e9


def _fs_now(directory: Path) -> int:
    probe = scratch_name(directory / "clock", "probe")
    probe.touch()
    try:
        return probe.stat().st_mtime_ns
    finally:
        probe.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _take_over(path: Path, holder: str) -> None:
    aside = scratch_name(path, "stale")
    try:
        os.rename(path, aside)  # one waiter wins the rename; the others find the file gone and retry
    except FileNotFoundError:
        return
    if _token(_read(aside)) != _token(holder):
        # Another waiter took the stale lock over first and this rename moved its fresh one: put it back (a link
        # never replaces a file created meanwhile). Losing that race costs a duplicate build, never a wrong entry.
        try:
            os.link(aside, path)
        except OSError:
            pass
    else:
        log.warning("%s: took over a stale lock (%s)", path, _describe(holder))
    aside.unlink(missing_ok=True)
