"""Real text available offline: the Python standard library's own source files.

Every CPython install carries them (no download), they are human-written (code, comments, docstrings) rather than
templates, and they have the long-range structure speculative decoding lives on (names defined once and reused,
indentation, idioms). The `small-real` target is pretrained on them (specdistill/launch/small_real.py).

Files are split by a hash of their path, so a file is wholly train or wholly held out: 1 in HELDOUT_EVERY files
is held out (prompts of the held-out rows come from them). Installed packages are left out, and so are files over
MAX_FILE_BYTES (generated tables, not prose or code anyone wrote).
"""

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

HELDOUT_EVERY = 20
MAX_FILE_BYTES = 256 * 1024
SKIPPED_DIRS = {"site-packages", "dist-packages", "__pycache__"}


@dataclass(frozen=True)
class CorpusFile:
    relpath: str  # posix path under the stdlib root
    text: str

    @property
    def heldout(self) -> bool:
        return int(hashlib.sha256(self.relpath.encode()).hexdigest(), 16) % HELDOUT_EVERY == 0


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(root: Path | None = None) -> list[CorpusFile]:
    """Every stdlib .py file outside SKIPPED_DIRS and under MAX_FILE_BYTES, sorted by path (the order is part of
    the build)."""
    root = root or stdlib_root()
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if SKIPPED_DIRS.intersection(rel.parts[:-1]) or path.stat().st_size > MAX_FILE_BYTES:
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        if text.strip():
            out.append(CorpusFile(rel.as_posix(), text))
    if not out:
        raise FileNotFoundError(f"{root}: no Python source files; the small-real corpus needs CPython's stdlib")
    return out


def split(files: list[CorpusFile]) -> tuple[list[CorpusFile], list[CorpusFile]]:
    return [f for f in files if not f.heldout], [f for f in files if f.heldout]


def digest(files: list[CorpusFile]) -> str:
    """sha256 over paths and texts: a build records it, and a rebuild on another Python refuses to claim equality."""
    h = hashlib.sha256()
    for f in files:
        h.update(f.relpath.encode() + b"\0" + f.text.encode() + b"\0")
    return h.hexdigest()
