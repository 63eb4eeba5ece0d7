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
