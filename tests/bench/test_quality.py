"""bench/quality.py's readings of a run's held-out curve (the bench itself is a benchmark, not a test)."""

from bench.quality import ablation_steps, curve_point, within_budget


def _point(step: int, seconds: float, tau: float) -> dict:
    return {"step": step, "training_seconds": seconds, "heldout_tau": tau, "heldout_per_position": [tau - 1.0]}


def test_within_budget_is_the_last_point_taken_inside_the_time_budget():
    metrics = {"heldout_curve": [_point(0, 0.0, 1.0), _point(100, 900.0, 2.0), _point(200, 1800.0, 2.5),
                                 _point(300, 2700.0, 3.0)]}
    assert within_budget(metrics)["step"] == 200  # 1800 s is inside a 30-minute budget
    assert within_budget(metrics, 1799.0)["step"] == 100
    assert within_budget(metrics, 10.0)["step"] == 0  # the untrained point is always inside
    assert within_budget(metrics, 1e9)["heldout_tau"] == 3.0


def test_within_budget_says_none_for_a_curve_without_times():
    old = {"heldout_curve": [{"step": 0, "heldout_tau": 1.0}, {"step": 100, "heldout_tau": 2.0}]}
    assert within_budget(old) is None
    assert within_budget({"heldout_curve": []}) is None


def test_the_ablation_is_compared_with_the_real_curve_at_its_own_last_step():
    steps = 450
    real = {"heldout_curve": [{"step": s, "heldout_tau": 1.0 + s / 100} for s in range(0, steps + 1, steps // 5)]}
    assert ablation_steps(steps) == 180 and curve_point(real, ablation_steps(steps)) == 2.8


def test_a_finished_run_is_reused_only_for_the_config_it_ran(tmp_path):
    """A run dir holding another config's finished run is refused, naming the key, never reprinted as this run."""
    import json

    import pytest

    from bench.quality import composed_config, train
    from specdistill.core.run_dir import RunDir

    run = RunDir(tmp_path / "dflash")
    run.path.mkdir(parents=True)
    asked = ["drafter=dflash", "target=small-real", "data=corpus", "trainer.max_steps=5", "trainer.progress=false"]
    ran = composed_config([*asked[:3], "trainer.max_steps=5", "trainer.progress=false", "drafter.loss=kl"])
    run.run_info.write_text(json.dumps({"git_sha": "abc123", "config": ran}))
    run.metrics.write_text(json.dumps({"tau_offline": 9.9}))
    with pytest.raises(SystemExit, match=r"another config \(drafter.loss: ran 'kl', asked 'ce'\)"):
        train("dflash", tmp_path / "dflash", 5, False, [], data=["data=corpus"])
    run.run_info.write_text(json.dumps({"git_sha": "abc123", "config": composed_config(asked)}))
    assert train("dflash", tmp_path / "dflash", 5, False, [], data=["data=corpus"]) == {"tau_offline": 9.9}


def test_warm_start_lines_set_the_two_curves_side_by_side_and_time_the_scratch_runs_last_tau():
    from bench.quality import minutes_to_reach, warm_start_lines

    scratch = {"steps": 300, "tau_offline": 3.0, "heldout_curve": [_point(0, 0.0, 1.0), _point(150, 180.0, 2.5),
                                                                   _point(300, 360.0, 3.1)]}
    warm = {"steps": 300, "tau_offline": 3.3, "heldout_curve": [_point(0, 0.0, 2.4), _point(150, 180.0, 3.2),
                                                                _point(300, 360.0, 3.4)]}
    base = {"steps": 100, "tau_offline": 2.45, "training_seconds": 120.0}
    assert minutes_to_reach(scratch["heldout_curve"], 3.1) == 6.0
    assert minutes_to_reach(warm["heldout_curve"], 3.1) == 3.0
    assert minutes_to_reach(warm["heldout_curve"], 9.0) is None
    lines = warm_start_lines("eagle3", base, scratch, warm)
    assert lines[0].startswith("eagle3 warm start from a 100-step run (2.0 min of training, its export's held-out "
                               "tau 2.450)")
    assert lines[2].split() == ["0", "0.00", "1.000", "0.00", "2.400"]
    assert "scratch 6.00, warm 3.00 (+ the base run's 2.0)" in lines[-2]
    assert lines[-1].endswith("scratch 3.000, warm 3.300")
    warm["heldout_curve"][-1]["heldout_tau"] = warm["heldout_curve"][1]["heldout_tau"] = 3.0
    assert "warm not reached" in warm_start_lines("eagle3", base, scratch, warm)[-2]


def test_the_default_is_one_shared_run_of_every_drafter_and_its_ablation(monkeypatch, tmp_path):
    """bench/quality.py trains the drafters and their ablations in one run (one prefill) and reads each one's figures
    out of metrics.json `drafters.<name>` beside the run's."""
    from types import SimpleNamespace

    import bench.quality as quality

    calls = []

    def fake_train(selector, run_dir, steps, quick, extra, committed=False):
        calls.append((selector, steps, extra))
        drafters = {n: {"tau_offline": 2.0 + i} for i, n in enumerate(("dflash", "dflash_zero", "eagle3", "eagle3_zero"))}
        return {"train_tokens": 100, "drafters": drafters, "baselines": {}}

    monkeypatch.setattr(quality, "train", fake_train)
    out = quality.train_shared(["dflash", "eagle3"], tmp_path, 10, SimpleNamespace(quick=True, set=[]), False)
    (selector, steps, extra), = calls
    assert selector == ("drafters=[dflash,{drafter:dflash,name:dflash_zero,trainer:{feature_ablation:zero}},"
                        "eagle3,{drafter:eagle3,name:eagle3_zero,trainer:{feature_ablation:zero}}]")
    assert steps == 10 and "trainer.eval_every=2" in extra
    assert out["eagle3"]["real"] == {"train_tokens": 100, "tau_offline": 4.0}
    assert out["eagle3"]["ablation"]["tau_offline"] == 5.0
