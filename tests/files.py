"""Small input files the tests write."""

import json


def write_jsonl(path, rows):
    """One JSON object per line (None: a blank line), parent directories made; returns the path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((json.dumps(r) if r is not None else "") + "\n" for r in rows))
    return path
