"""Fixtures shared by the trainer tests that build a Trainer."""

import pytest


@pytest.fixture(scope="session")
def tiny_llama_workload(tiny_target, cache_dir):
    """(target dir, train file, held-out file): tiny-llama and its generated workload (16 training rows, 3
    held-out; the settings tests/test_many_drafters.py uses, so the session builds it once)."""
    from specdistill.launch.config import DataConfig
    from specdistill.launch.prepare import resolve_data

    target = tiny_target("tiny-llama")
    train, heldout = resolve_data(DataConfig(rows=16, heldout_rows=3, prompt_tokens=60, max_new_tokens=12), target,
                                  cache_dir)
    return target, train, heldout
