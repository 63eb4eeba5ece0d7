"""Where the installed package keeps its committed checkpoints and data (specdistill/launch/assets/).

A module of its own so that naming these folders imports nothing heavy: the train command reads SMALL_REAL_DIR,
and specdistill/launch/small_real.py (which builds the checkpoint) imports transformers' models.
"""

import importlib.resources
from pathlib import Path


def packaged_asset(name: str) -> Path:
    """A folder of specdistill/launch/assets/ where the installed package holds it (a wheel's site-packages or a
    checkout; pyproject.toml ships them as package data): transformers and vLLM open these checkpoints by path."""
    return Path(str(importlib.resources.files("specdistill.launch").joinpath("assets", name)))


SMALL_REAL_DIR = packaged_asset("small-real")
SMALL_REAL_CORPUS_DIR = packaged_asset("small-real-corpus")  # 3,000 + 64 rows of real text continued by small-real
