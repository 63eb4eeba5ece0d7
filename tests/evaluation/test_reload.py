"""Which drafter of a run the evaluation tools read (specdistill/evaluation/reload.py): a `drafter=NAME` run's flat
metrics.json and export/, a `drafters=[...]` run's per-drafter part and export/<name>/, and errors that name them."""

import json

import pytest

from specdistill.core.run_dir import RunDir
from specdistill.evaluation.reload import drafter_metrics, drafter_names, export_dir


def _shared(tmp_path):
    run = RunDir(tmp_path / "shared")
    run.path.mkdir()
    run.metrics.write_text(json.dumps({"target": "T", "steps": 9, "drafters": {
        "dflash": {"name": "dflash", "num_speculative_tokens": 15, "steps": 9},
        "eagle3": {"name": "eagle3", "num_speculative_tokens": 7, "steps": 4}}}))
    return run.path


def test_a_shared_runs_drafters_are_read_by_name(tmp_path):
    run = _shared(tmp_path)
    assert drafter_names(run) == ["dflash", "eagle3"]
    eagle3 = drafter_metrics(run, "eagle3")
    assert eagle3["num_speculative_tokens"] == 7 and eagle3["steps"] == 4 and eagle3["target"] == "T"
    assert export_dir(run, "dflash") == run / "export" / "dflash"
    with pytest.raises(ValueError, match=r"trained drafters \['dflash', 'eagle3'\]: name the one"):
        drafter_metrics(run)
    with pytest.raises(KeyError, match=r"no drafter 'mtp'; it trained \['dflash', 'eagle3'\]"):
        export_dir(run, "mtp")


def test_a_one_drafter_run_is_read_without_a_name(tmp_path):
    run = RunDir(tmp_path / "solo")
    run.checkpoints.mkdir(parents=True)
    run.metrics.write_text(json.dumps({"target": "T", "num_speculative_tokens": 15}))
    assert drafter_metrics(run.path)["num_speculative_tokens"] == 15
    assert export_dir(run.path) == run.export
    with pytest.raises(FileNotFoundError, match="no checkpoint"):  # a name is checked against the checkpoint's
        drafter_metrics(run.path, "eagle3")
