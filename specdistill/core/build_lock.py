"""One builder per cache entry. Processes that need the same tiny target or workload at once (a test session's
parallel workers, two runs on one node sharing a cache) wait for the first builder instead of building it again,
and never replace an entry another process is reading."""

import fcntl
import logging
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger(__name__)


def lock_path(entry: Path) -> Path:
    return entry.parent / f".{entry.name}.lock"


@contextmanager
def build_lock(entry: str | Path):
    """An exclusive flock on `.<entry name>.lock` beside the cache entry, held for the block. The kernel drops the
    lock when its holder exits, so a builder killed mid-build (kill -9 included) never blocks the next one; the
    lock file itself stays (removing it would let a waiter lock an unlinked file)."""
    entry = Path(entry)
    entry.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path(entry), "a") as f:  # closing the file releases the lock
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process building %s", entry)
            fcntl.flock(f, fcntl.LOCK_EX)
        yield
