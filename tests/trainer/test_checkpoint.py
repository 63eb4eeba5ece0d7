"""Checkpoints are atomic: a crash in the middle of a save leaves the previous checkpoint the one resumed from."""

import pytest
import torch
from torch import nn

from specdistill.core.run_dir import RunDir
from specdistill.trainer import checkpoint, parallel
from specdistill.trainer.checkpoint import TrainState, load_checkpoint, rank_entry, save_checkpoint
from specdistill.trainer.config import TrainerConfig
from specdistill.trainer.optim import Optimizers

META = {"model_type": "llama", "drafters": {"dflash": {"drafter": "dflash", "target_layer_ids": [1, 2]}}}


def _parts(seed: int):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
    optimizers = Optimizers(model, TrainerConfig())
    model(torch.randn(4, 8)).sum().backward()
    optimizers.step()  # Muon and AdamW both hold state now
    return model, optimizers, torch.Generator().manual_seed(seed)


def _save(tmp_path, states: list[TrainState], model, optimizers, generator, stopped=None):
    """What Trainer._save writes: full model/optimizer states per drafter and one entry per rank."""
    own = {"dflash": {"generator": generator.get_state(), "steps": states[0].step, "train_seconds": 1.0,
                      "last_loss": 0.5, "stopped": stopped}}
    drafters = {"dflash": {"drafter": parallel.model_state(model),
                           "optimizers": parallel.optimizer_state(model, optimizers.optimizers), "validation": None}}
    return save_checkpoint(RunDir(tmp_path), states[0].step, [rank_entry(s, own) for s in states], drafters, META, 2)


def test_a_crash_during_save_leaves_the_previous_checkpoint_usable(tmp_path, monkeypatch):
    model, optimizers, generator = _parts(0)
    _save(tmp_path, [TrainState(step=1, consumed_row_ids={3, 5})], model, optimizers, generator)
    saved = {k: v.clone() for k, v in model.state_dict().items()}

    def dies_halfway(obj, path):
        with open(path, "wb") as f:  # what a kill -9 in the middle of torch.save leaves behind
            f.write(b"PK\x03\x04 partial")
        raise KeyboardInterrupt  # the process is going down

    with torch.no_grad():
        model[0].weight.add_(1.0)
    monkeypatch.setattr(checkpoint.torch, "save", dies_halfway)
    with pytest.raises(KeyboardInterrupt):
        _save(tmp_path, [TrainState(step=2)], model, optimizers, generator)
    monkeypatch.undo()

    path = RunDir(tmp_path).latest_checkpoint()
    assert path.name == "step_00000001.pt"  # the half-written step 2 is only ever a .tmp
    fresh, fresh_opt, fresh_gen = _parts(1)
    ckpt = load_checkpoint(path, META)
    parallel.load_model_state(fresh, ckpt.drafters["dflash"]["drafter"])
    parallel.load_optimizer_state(fresh, fresh_opt.optimizers, ckpt.drafters["dflash"]["optimizers"])
    state, own = ckpt.rank_state(0, 1)
    assert state.step == 1 and state.consumed_row_ids == {3, 5}
    assert all(torch.equal(saved[k], v) for k, v in fresh.state_dict().items())
    assert torch.equal(own["dflash"]["generator"], generator.get_state()) and own["dflash"]["steps"] == 1
    for ours, theirs in zip(fresh_opt.optimizers, optimizers.optimizers):  # Muon momentum, AdamW moments
        a, b = ours.state_dict()["state"], theirs.state_dict()["state"]
        assert a.keys() == b.keys() and all(torch.equal(a[i][k], b[i][k]) for i in a for k in a[i])


def test_a_checkpoint_of_two_ranks_resumes_each_rank_or_any_other_count(tmp_path):
    model, optimizers, generator = _parts(0)
    states = [TrainState(step=4, consumed_row_ids={0, 2}, train_tokens=100, samples_lost=0, train_seconds=10.0),
              TrainState(step=4, consumed_row_ids={1, 3, 5}, train_tokens=150, samples_lost=0, train_seconds=10.5)]
    stopped = {"step": 3, "last_finite_loss": 0.5, "loss": float("inf"), "why": "diverged", "train_tokens": 80}
    ckpt = load_checkpoint(_save(tmp_path, states, model, optimizers, generator, stopped), META)
    assert ckpt.rank_state(1, 2)[0].consumed_row_ids == {1, 3, 5}  # the same ranks: each its own
    assert ckpt.rank_state(1, 2)[0].train_tokens == 150
    # Three ranks now: every one skips what any rank trained on (it only meets its own shard's rows), and the
    # counters are carried once, by rank 0, so the job's totals (summed over ranks) stay the same.
    resumed = [ckpt.rank_state(r, 3) for r in range(3)]
    assert all(s.consumed_row_ids == {0, 1, 2, 3, 5} and s.step == 4 for s, _ in resumed)
    # The drafter's progress is the same on every rank (a stopped drafter stays stopped); its RNG starts fresh.
    assert all(g == {"dflash": {"steps": 4, "train_seconds": 1.0, "last_loss": 0.5, "stopped": stopped}}
               for _, g in resumed)
    assert [s.train_tokens for s, _ in resumed] == [250, 0, 0]
    assert [s.train_seconds for s, _ in resumed] == [10.0] * 3  # wall-clock: rank 0's, not a sum


def test_a_checkpoint_of_another_setup_is_refused(tmp_path):
    model, optimizers, generator = _parts(0)
    path = _save(tmp_path, [TrainState(step=1)], model, optimizers, generator)
    other_layers = {**META, "drafters": {"dflash": {"drafter": "dflash", "target_layer_ids": [1, 3]}}}
    with pytest.raises(ValueError, match="'dflash' was written with target_layer_ids=\\[1, 2\\].*new hydra.run.dir"):
        load_checkpoint(path, other_layers)
    more_drafters = {**META, "drafters": {**META["drafters"], "eagle3": {"drafter": "eagle3", "target_layer_ids": [2]}}}
    with pytest.raises(ValueError, match=r"holds drafters \['dflash'\], this run trains \['dflash', 'eagle3'\]"):
        load_checkpoint(path, more_drafters)
