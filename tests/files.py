"""Small input files the tests write, and random tiny targets (checkpoints in seconds)."""

import json


def write_jsonl(path, rows):
    """One JSON object per line (None: a blank line), parent directories made; returns the path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((json.dumps(r) if r is not None else "") + "\n" for r in rows))
    return path


def build_random_target(name: str, tmp_path_factory) -> str:
    """specdistill.launch.targets' tiny target, random weights (fit_steps=0): a few seconds instead of minutes of fitting."""
    from specdistill.launch.targets import make_target

    return str(make_target(name, tmp_path_factory.mktemp(name), fit_steps=0))
