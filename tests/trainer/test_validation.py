"""Held-out acceptance during training (specdistill/trainer/validation.py), the best-weights export, feature ablation, and the
bad inputs of validation: eval intervals, all-prompt and too-short held-out sets."""

import json

import pytest
import torch

from specdistill.core.run_dir import RunDir
from specdistill.drafters import DRAFTERS
from specdistill.feature_server.config import FeatureServerConfig
from specdistill.launch.config import DataConfig
from specdistill.launch.prepare import resolve_data
from specdistill.trainer.ablation import ablate_hidden, check_ablation
from specdistill.trainer.checkpoint import load_checkpoint
from specdistill.trainer.config import TrainerConfig
from specdistill.trainer.trainer import Trainer
from specdistill.trainer.validation import check_eval_settings, resolve_eval_every


@pytest.fixture(scope="module")
def data(tiny_target, cache_dir):
    target = tiny_target("tiny-llama")
    train, heldout = resolve_data(DataConfig(rows=12, heldout_rows=3, prompt_tokens=60, max_new_tokens=12), target,
                                  cache_dir)
    return target, train, heldout


def _trainer(data, run_dir, **overrides):
    target, train, heldout = data
    drafter_cfg = DRAFTERS["dflash"][0](num_layers=1, max_anchors=32, block_size=4)
    cfg = dict(max_steps=6, ranks=1, device="cpu", token_budget=512, progress=False, checkpoint_every=3,
               eval_every=2, eval_rows=3, lr=3e-3, muon_lr=0.02)
    cfg.update(overrides)
    run_dir.mkdir(parents=True, exist_ok=True)  # specdistill.launch.train's Hydra makes it
    return Trainer(drafter_cfg, TrainerConfig(**cfg), FeatureServerConfig(workers=1), run_dir, target, train, heldout)


@pytest.mark.slow
def test_held_out_curve_best_export_and_resume_keep_the_best(data, tmp_path):
    trainer = _trainer(data, tmp_path / "run")
    metrics = trainer.train()
    curve = metrics["heldout_curve"]
    assert [p["step"] for p in curve] == [0, 2, 4, 6]  # step 0: the untrained drafter
    seconds = [p["training_seconds"] for p in curve]  # time in training steps when each point was taken
    assert seconds[0] == 0 and seconds == sorted(seconds) and seconds[-1] <= metrics["training_seconds"]
    for point in curve:
        assert point["train_rows_tau"] is not None and point["gap"] == pytest.approx(
            point["train_rows_tau"] - point["heldout_tau"])
    best = max(curve, key=lambda p: p["heldout_tau"])  # ties: the first (strictly better replaces)
    assert metrics["export_selected"] == {"policy": "best", "step": best["step"], "heldout_tau": best["heldout_tau"]}
    # The exported weights re-walked on the rows the curve (and so the choice) used, and on the other half.
    assert metrics["tau_offline_selection_rows"] == pytest.approx(best["heldout_tau"])
    assert metrics["heldout_split"] == {"selection_rows": 2, "report_rows": 1, "split": True}
    # tau is what the report's counts say, and every report row was walked (>= 1 draft step each)
    assert metrics["tau_offline"] == pytest.approx(1 + sum(metrics["per_position_acceptance"]))
    assert metrics["heldout_drafts"] >= metrics["heldout_split"]["report_rows"]
    saved = load_checkpoint(trainer.run.latest_checkpoint(), trainer.meta)
    validation = saved.drafters["dflash"]["validation"]
    assert validation["best_step"] == best["step"] and validation["curve"] == curve
    log = [json.loads(line) for line in RunDir(tmp_path / "run").train_log.read_text().splitlines()]
    assert [r["step"] for r in log if "heldout/heldout_tau" in r] == [0, 2, 4, 6]
    # A run resumed from its step-3 checkpoint knows the step-2 point and continues the same curve.
    RunDir(tmp_path / "run").checkpoint(6).unlink()
    resumed = _trainer(data, tmp_path / "run").train()
    assert [p["step"] for p in resumed["heldout_curve"]] == [0, 2, 4, 6]
    assert resumed["heldout_curve"][:2] == curve[:2]


def test_probe_rows_default_to_the_held_out_count_and_can_be_fewer_or_none(data, tmp_path):
    """trainer.probe_rows: the training rows walked beside the held-out ones (each costs extraction and a walk at
    every point); None = as many as held-out, 0 = no probe (the curve's train_rows_tau is then None)."""
    for probe_rows, expected in ((None, 3), (1, 1), (0, 0)):
        heldout, probe = _trainer(data, tmp_path / f"run{probe_rows}", probe_rows=probe_rows)._eval_rows()
        assert len(heldout) == 3 and len(probe) == expected
        assert {r.row_id for r in probe}.isdisjoint(r.row_id for r in heldout)


def test_eval_settings_fail_clearly():
    with pytest.raises(ValueError, match=r"trainer.eval_every=500 is larger than trainer.max_steps=200"):
        check_eval_settings(500, 200, "best")
    with pytest.raises(ValueError, match=r"trainer.export='final'; valid: best, last"):
        check_eval_settings(10, 200, "final")
    assert resolve_eval_every(None, 200) == 40 and resolve_eval_every(None, 3) == 1
    assert resolve_eval_every(None, 10**6) == 500 and resolve_eval_every(0, 200) == 0


@pytest.mark.slow
def test_held_out_rows_that_are_all_prompt_or_too_short_fail_naming_the_file(data, tmp_path):
    target, train, _ = data
    rows = [json.loads(line) for line in open(train)][:3]
    all_prompt = tmp_path / "all_prompt.jsonl"
    all_prompt.write_text("".join(json.dumps({**r, "loss_mask": [0] * len(r["loss_mask"])}) + "\n" for r in rows))
    with pytest.raises(ValueError, match=rf"{all_prompt}: no usable held-out row .*no_response_tokens=3"):
        _trainer((target, train, all_prompt), tmp_path / "a")
    one_token = tmp_path / "one_token.jsonl"
    one_token.write_text("".join(json.dumps({**r, "loss_mask": [0] * (len(r["loss_mask"]) - 1) + [1]}) + "\n"
                                 for r in rows))
    with pytest.raises(ValueError, match=rf"{one_token}: no held-out row has a response of >= 2 tokens"):
        _trainer((target, train, one_token), tmp_path / "b")


def test_ablation_takes_the_inputs_away_and_keeps_the_labels():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(10, 3, 4, generator=g)
    layer_ids = (1, 2, 4)
    zero = ablate_hidden(hidden, layer_ids, "zero", [1, 2], g)
    assert zero[:, :2].abs().sum() == 0 and torch.equal(zero[:, 2], hidden[:, 2])
    shuffled = ablate_hidden(hidden, layer_ids, "shuffle", [1, 2], g)
    assert torch.equal(shuffled[:, 2], hidden[:, 2]) and not torch.equal(shuffled[:, 0], hidden[:, 0])
    assert torch.equal(shuffled[:, 0].sort(0).values, hidden[:, 0].sort(0).values)  # the same states, moved
    assert ablate_hidden(hidden, layer_ids, "none", [1, 2], g) is hidden
    # A padded pack (6 real tokens, then padding's zero states) is shuffled as its unpadded one: same permutation of
    # the real positions, padding left as it was.
    padded = torch.cat([hidden[:6], torch.zeros(4, 3, 4)])
    ours = ablate_hidden(padded, layer_ids, "shuffle", [1, 2], torch.Generator().manual_seed(1), real_tokens=6)
    unpadded = ablate_hidden(hidden[:6], layer_ids, "shuffle", [1, 2], torch.Generator().manual_seed(1))
    assert torch.equal(ours[:6], unpadded) and ours[6:].abs().sum() == 0
    with pytest.raises(ValueError, match="reads layer 4"):
        check_ablation("zero", [4], 4)
    with pytest.raises(ValueError, match="valid: none, zero, shuffle"):
        check_ablation("noise", [1], 4)


def test_held_out_rows_split_into_selection_and_report_halves():
    from types import SimpleNamespace

    from specdistill.trainer.validation import split_heldout

    rows = [SimpleNamespace(row_id=i) for i in (5, 1, 9, 3, 7)]
    selection, report = split_heldout(rows)
    assert [r.row_id for r in selection] == [1, 5, 9] and [r.row_id for r in report] == [3, 7]
    one = [SimpleNamespace(row_id=4)]
    assert split_heldout(one) == (one, one)  # nothing to split: both walk it (metrics say split: false)
