"""Checkpoints are atomic and durable: a crash in the middle of a save leaves the previous checkpoint the one resumed
from, the file and the rename are on disk before the save returns, and a newest checkpoint that does not load is
passed over for the one before it. A resume never loads one drafter entry with another's state."""

import logging
import os

import pytest
import torch
from torch import nn

from specdistill.core.run_dir import RunDir, read_checkpoint
from specdistill.drafters import drafter_config
from specdistill.feature_server.config import FeatureServerConfig
from specdistill.trainer import checkpoint, parallel
from specdistill.trainer.checkpoint import (TrainState, check_entry, load_checkpoint, load_latest_checkpoint,
                                            rank_entry, save_checkpoint)
from specdistill.trainer.config import TrainerConfig
from specdistill.trainer.optim import Optimizers
from specdistill.trainer.trainer import Trainer

META = {"model_type": "llama", "drafters": {"dflash": {"drafter": "dflash", "target_layer_ids": [1, 2]}}}


def _parts(seed: int):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
    optimizers = Optimizers(model, TrainerConfig())
    model(torch.randn(4, 8)).sum().backward()
    optimizers.step()  # Muon and AdamW both hold state now
    return model, optimizers, torch.Generator().manual_seed(seed)


def _save(tmp_path, states: list[TrainState], model, optimizers, generator, stopped=None, keep=2):
    """What Trainer._save writes: full model/optimizer states per drafter and one entry per rank."""
    own = {"dflash": {"generator": generator.get_state(), "steps": states[0].step, "train_seconds": 1.0,
                      "last_loss": 0.5, "stopped": stopped}}
    drafters = {"dflash": {"drafter": parallel.model_state(model),
                           "optimizers": parallel.optimizer_state(model, optimizers.optimizers), "validation": None}}
    return save_checkpoint(RunDir(tmp_path), states[0].step, [rank_entry(s, own) for s in states], drafters, META,
                           keep)


def test_a_crash_during_save_leaves_the_previous_checkpoint_usable(tmp_path, monkeypatch):
    model, optimizers, generator = _parts(0)
    _save(tmp_path, [TrainState(step=1, consumed_row_ids={3, 5})], model, optimizers, generator)
    saved = {k: v.clone() for k, v in model.state_dict().items()}

    def dies_halfway(obj, f):
        f.write(b"PK\x03\x04 partial")  # what a kill -9 in the middle of torch.save leaves behind
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


def test_a_save_is_on_disk_before_it_returns(tmp_path, monkeypatch):
    """The file's bytes are fsynced before the rename, and the directory (the rename itself) after it: a machine
    crash cannot keep the new name over bytes that never reached the disk."""
    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(checkpoint.os, "fsync", lambda fd: events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
                        or real_fsync(fd))
    monkeypatch.setattr(checkpoint.os, "replace", lambda a, b: events.append(("replace", str(b))) or real_replace(a, b))
    path = _save(tmp_path, [TrainState(step=1)], *_parts(0))
    run = RunDir(tmp_path)
    assert events == [("fsync", str(run.staging_checkpoint(1))), ("replace", str(path)),
                      ("fsync", str(run.checkpoints))]


def _truncate(path, keep_fraction=0.5):
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep_fraction)])  # what a crashed machine can leave of a file


def test_a_resume_passes_over_a_newest_checkpoint_that_does_not_load(tmp_path, caplog):
    model, optimizers, generator = _parts(0)
    _save(tmp_path, [TrainState(step=1)], model, optimizers, generator)
    newest = _save(tmp_path, [TrainState(step=2)], model, optimizers, generator)
    _truncate(newest)
    with caplog.at_level(logging.WARNING, logger="specdistill.trainer.checkpoint"):
        ckpt = load_latest_checkpoint(RunDir(tmp_path), META, keep=2)
    assert ckpt.path.name == "step_00000001.pt" and ckpt.rank_state(0, 1)[0].step == 1
    assert "resuming from" in caplog.text and "the newer step_00000002.pt does not load (" in caplog.text
    assert load_latest_checkpoint(RunDir(tmp_path / "empty"), META, keep=2) is None  # nothing saved: a fresh start


def test_every_rank_resumes_from_a_checkpoint_all_of_them_read(tmp_path):
    """The newest loads here but not on rank 1 (its node reads a torn copy): every rank takes the one before."""
    model, optimizers, generator = _parts(0)
    _save(tmp_path, [TrainState(step=1)], model, optimizers, generator)
    _save(tmp_path, [TrainState(step=2)], model, optimizers, generator)
    rank_1_reads = iter(["RuntimeError: torn", None])  # rank 1's read of step 2, then of step 1
    gathered = []

    def gather(mine):  # distributed.gather_objects on rank 0 of 2
        everyone = [mine, mine] if isinstance(mine, list) else [mine, next(rank_1_reads)]
        gathered.append(everyone)
        return everyone

    ckpt = load_latest_checkpoint(RunDir(tmp_path), META, keep=2, gather=gather)
    assert ckpt.path.name == "step_00000001.pt"
    assert gathered[1:] == [[None, "RuntimeError: torn"], [None, None]]


def test_with_one_checkpoint_kept_a_torn_one_says_there_is_none_to_fall_back_to(tmp_path):
    path = _save(tmp_path, [TrainState(step=1)], *_parts(0), keep=1)
    _truncate(path)
    with pytest.raises(RuntimeError, match=r"no checkpoint loads: step_00000001.pt does not load \(.*"
                                           r"trainer.keep_checkpoints=1 keeps no earlier checkpoint to fall back to"):
        load_latest_checkpoint(RunDir(tmp_path), META, keep=1)


# --- through the Trainer: entries resumed as written; a torn newest checkpoint ------------------------------------
DFLASH = {"drafter": "dflash", "num_layers": 1, "max_anchors": 16, "block_size": 4}


def _trainer(workload, run_dir, entries=None, **overrides):
    target, train, _ = workload
    cfg = TrainerConfig(**{**dict(max_steps=4, ranks=1, device="cpu", threads=1, token_budget=256, progress=False,
                                  checkpoint_every=1, eval_every=0), **overrides})
    run_dir.mkdir(parents=True, exist_ok=True)
    drafter = drafter_config("dflash", {k: v for k, v in DFLASH.items() if k != "drafter"})
    return Trainer(drafter, cfg, FeatureServerConfig(workers=1), run_dir, target, train, None, entries=entries)


def test_a_resume_refuses_entries_swapped_or_changed_and_allows_an_implementation_change(tiny_llama_workload,
                                                                                          tmp_path):
    """[dflash, {dflash, block_size 8}] resumed as the same two entries in the other order: each name now holds the
    other's settings, so each would load the other's weights, optimizer and curve."""
    written = [DFLASH, {**DFLASH, "block_size": 8}]
    _trainer(tiny_llama_workload, tmp_path, written)._save(TrainState())
    swapped = _trainer(tiny_llama_workload, tmp_path, written[::-1])
    with pytest.raises(ValueError, match=r"drafter 'dflash' was written with block_size=4, this run has "
                                         r"block_size=8.*in another order renames the entries"):
        swapped._resume()
    # attention_impl changes how attention is computed, not what is trained: the resume goes on
    same = _trainer(tiny_llama_workload, tmp_path, [{**DFLASH, "attention_impl": "reference"}, written[1]])
    assert same._resume().step == 0


def test_an_entrys_own_trainer_settings_are_part_of_what_it_resumes_as():
    lr = {"drafter": "dflash", "target_layer_ids": [1], "config": {"block_size": 4}, "trainer": {"lr": 0.001}}
    plain = {**lr, "trainer": {}}
    with pytest.raises(ValueError, match=r"'dflash' was written with trainer.lr=0.001, this run has "
                                         r"trainer.lr='<not set>'"):
        check_entry("ckpt", "dflash", lr, plain)
    check_entry("ckpt", "dflash", lr, {**lr, "config": {"block_size": 4, "attention_impl": "flex"}})


@pytest.mark.slow
def test_a_torn_newest_checkpoint_resumes_from_the_one_before_and_ends_as_an_uninterrupted_run(tiny_llama_workload,
                                                                                               tmp_path, caplog):
    _trainer(tiny_llama_workload, tmp_path).train()
    run = RunDir(tmp_path)
    assert [p.name for p in run.checkpoint_files()] == ["step_00000003.pt", "step_00000004.pt"]
    straight = read_checkpoint(run.checkpoint(4))["drafters"]["dflash"]
    _truncate(run.checkpoint(4))
    with caplog.at_level(logging.INFO):
        _trainer(tiny_llama_workload, tmp_path).train()
    assert "the newer step_00000004.pt does not load (" in caplog.text
    assert "step_00000003.pt at step 3" in caplog.text  # resumed from the one before, then trained step 4 again
    resumed = read_checkpoint(run.checkpoint(4))["drafters"]["dflash"]
    assert _equal(straight["drafter"], resumed["drafter"]) and _equal(straight["optimizers"], resumed["optimizers"])


def _equal(a, b) -> bool:
    """Nested dicts and lists of tensors, equal bit for bit."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(_equal, a, b))
    return a == b
