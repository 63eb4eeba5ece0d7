"""Several drafters from one prefill (specdistill/trainer/entries.py): each gets what its solo run gets.

With the same seed, rows, steps and threads (fp32 on CPU, the transformers backend), each drafter's weights after a
shared run equal its solo run's, and so does its held-out tau; the shared run is resumed half way (one checkpoint
holds both drafters). A drafter whose loss goes non-finite stops, recorded, while the other goes on."""

import json
from dataclasses import replace

import pytest
import torch

from specdistill.core.run_dir import RunDir
from specdistill.core.run_dir import read_checkpoint
from specdistill.drafters import drafter_config
from specdistill.feature_server.config import FeatureServerConfig
from specdistill.launch.config import DataConfig
from specdistill.launch.prepare import resolve_data
from specdistill.trainer.checkpoint import TrainState
from specdistill.trainer.config import TrainerConfig
from specdistill.trainer.entries import resolve_entries
from specdistill.trainer.trainer import Trainer

DFLASH = {"drafter": "dflash", "num_layers": 1, "max_anchors": 16, "block_size": 4}
EAGLE3 = {"drafter": "eagle3", "draft_vocab_size": 64}
STEPS = 4


@pytest.fixture(scope="module")
def data(tiny_target, cache_dir):
    target = tiny_target("tiny-llama")
    train, heldout = resolve_data(DataConfig(rows=16, heldout_rows=3, prompt_tokens=60, max_new_tokens=12), target,
                                  cache_dir)
    return target, train, heldout


def _run(data, run_dir, entries, steps=STEPS):
    target, train, heldout = data
    cfg = TrainerConfig(max_steps=steps, ranks=1, device="cpu", threads=1, token_budget=256, progress=False,
                        checkpoint_every=2, eval_every=0, eval_rows=2, probe_rows=0)
    run_dir.mkdir(parents=True, exist_ok=True)
    # drafter_cfg is the `drafter` group's: unused when entries are given
    trainer = Trainer(drafter_config("dflash"), cfg, FeatureServerConfig(workers=1), run_dir, target, train, heldout,
                      entries=entries)
    return trainer.train()


def _weights(run_dir, name):
    return read_checkpoint(RunDir(run_dir).latest_checkpoint())["drafters"][name]["drafter"]


@pytest.mark.slow
def test_each_drafter_of_a_shared_run_trains_as_its_solo_run(data, tmp_path):
    solo = {name: _run(data, tmp_path / name, [entry]) for name, entry in (("dflash", DFLASH), ("eagle3", EAGLE3))}
    _run(data, tmp_path / "shared", [DFLASH, EAGLE3], steps=STEPS // 2)  # stopped half way, then resumed
    shared = _run(data, tmp_path / "shared", [DFLASH, EAGLE3])
    assert sorted(p.name for p in (tmp_path / "shared" / "export").iterdir()) == ["dflash", "eagle3"]
    for name in ("dflash", "eagle3"):
        ours, theirs = _weights(tmp_path / "shared", name), _weights(tmp_path / name, name)
        assert ours.keys() == theirs.keys()
        diff = max(float((ours[k].float() - theirs[k].float()).abs().max()) for k in ours)
        assert diff <= 1e-6, (name, diff)
        mine, alone = shared["drafters"][name], solo[name]["drafters"][name]
        assert mine["steps"] == alone["steps"] == STEPS and mine["stopped_early"] is None
        assert mine["tau_offline"] == alone["tau_offline"]
        assert mine["per_position_acceptance"] == alone["per_position_acceptance"]
    # Once for the run: the prefill (every row once, whatever the drafters), and the baselines beside them.
    assert shared["target_tokens_prefilled"] > 0 and shared["baselines"]["bigram"]["tau"] >= 1
    # Each drafter beside baselines that draft as many tokens (DFlash's blocks of 4: K 3; EAGLE-3: K 7); the run's
    # at the largest K.
    Ks = {name: shared["drafters"][name]["baselines"]["ngram"]["K"] for name in ("dflash", "eagle3")}
    assert Ks == {"dflash": 3, "eagle3": 7} and shared["baselines"]["ngram"]["K"] == 7
    assert json.loads((tmp_path / "shared" / "metrics.json").read_text())["drafters"].keys() == {"dflash", "eagle3"}


@pytest.mark.slow
def test_a_drafter_whose_loss_goes_non_finite_stops_and_the_others_go_on(data, tmp_path):
    target, train, heldout = data
    cfg = TrainerConfig(max_steps=4, ranks=1, device="cpu", threads=1, token_budget=1024, progress=False)
    trainer = Trainer(drafter_config("dflash"), cfg, FeatureServerConfig(workers=1), tmp_path, target, train, heldout,
                      entries=[DFLASH, EAGLE3])
    with trainer._server(trainer.rows[:3]) as server:
        from specdistill.core.batch import pack

        batch = pack(list(server), trainer.spec.layer_ids)
    eagle = trainer.entries[1]
    real = eagle.model
    eagle.model = lambda b, head, gen: replace(real(b, head, gen), loss=torch.tensor(float("nan")))
    before = {k: v.clone() for k, v in eagle.drafter.state_dict().items()}
    state = TrainState(step=2)
    trainer._step(batch, state)
    assert state.step == 3 and trainer.entries[0].steps == 1 and trainer.entries[0].active
    assert eagle.stopped["step"] == 3 and "loss is nan" in eagle.stopped["why"] and eagle.steps == 0
    assert eagle.stopped["train_tokens"] == 0  # what its last weights (step 2's) had seen here
    assert all(torch.equal(before[k], v) for k, v in eagle.drafter.state_dict().items())

    class InfiniteGradient(torch.autograd.Function):  # a finite loss whose gradients are not
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            return g * float("inf")

    dflash = trainer.entries[0]
    real_dflash = dflash.model
    dflash.model = lambda b, head, gen: (lambda out: replace(out, loss=InfiniteGradient.apply(out.loss)))(
        real_dflash(b, head, gen))
    before = {k: v.clone() for k, v in dflash.drafter.state_dict().items()}
    with pytest.raises(FloatingPointError, match=r"dflash: step 4: the loss is finite but its gradients are not.*"
                                                 r"eagle3: step 3: loss is nan"):
        trainer._step(batch, state)  # none left: the run fails
    assert state.step == 3 and dflash.steps == 1
    assert all(torch.equal(before[k], v) for k, v in dflash.drafter.state_dict().items())  # no inf/nan step


def test_entries_are_named_by_kind_with_repeats_numbered_and_settings_kept_apart():
    specs = resolve_entries(["dflash", {"drafter": "dflash", "block_size": 16, "trainer": {"lr": 0.001}}, "eagle3",
                             {"drafter": "eagle3", "name": "eagle3_zero", "trainer": {"feature_ablation": "zero"}}],
                            drafter_config("dflash"), TrainerConfig(lr=0.003))
    assert [s.name for s in specs] == ["dflash", "dflash_2", "eagle3", "eagle3_zero"]
    assert [s.drafter.block_size for s in specs[:2]] == [8, 16] and [s.trainer.lr for s in specs[:2]] == [0.003, 0.001]
    assert specs[3].trainer.feature_ablation == "zero" and specs[2].trainer.feature_ablation == "none"
    with pytest.raises(ValueError, match=r"trainer settings \['max_steps'\] cannot differ between entries"):
        resolve_entries([{"drafter": "dflash", "trainer": {"max_steps": 3}}], None, TrainerConfig())
    with pytest.raises(ValueError, match=r"entry names \['x'\] are used twice"):
        resolve_entries([{"drafter": "dflash", "name": "x"}, {"drafter": "eagle3", "name": "x"}], None,
                        TrainerConfig())
    with pytest.raises(ValueError, match=r"drafter 'dflash' has no field\(s\) \['blocksize'\]"):
        resolve_entries([{"drafter": "dflash", "blocksize": 16}], None, TrainerConfig())
