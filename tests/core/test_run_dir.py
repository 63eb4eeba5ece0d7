"""The run directory's file names are the CLI contract (README.md "The main job"): stated once, in RunDir."""

from specdistill.core.run_dir import RunDir


def test_names_are_the_documented_ones(tmp_path):
    run = RunDir(tmp_path)
    assert run.metrics == tmp_path / "metrics.json" and run.export == tmp_path / "export"
    assert run.run_info == tmp_path / "run_info.json" and run.train_log == tmp_path / "train_log.jsonl"
    assert run.checkpoint(50) == tmp_path / "checkpoints" / "step_00000050.pt"


def test_latest_checkpoint_is_the_highest_complete_step(tmp_path):
    run = RunDir(tmp_path)
    assert run.latest_checkpoint() is None  # no checkpoints/ yet
    run.checkpoints.mkdir()
    for path in (run.checkpoint(9), run.checkpoint(10), run.staging_checkpoint(11)):
        path.write_bytes(b"")
    assert run.latest_checkpoint() == run.checkpoint(10)  # steps sort as numbers; a half-written save never counts
    assert run.checkpoint_files() == [run.checkpoint(9), run.checkpoint(10)]
    assert run.staging_files() == [run.staging_checkpoint(11)]
