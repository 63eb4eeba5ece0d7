"""Several drafters from one prefill (specdistill/trainer/entries.py): each gets what its solo run gets.

With the same seed, rows, steps and threads (fp32 on CPU, the transformers backend), each drafter's weights after a
shared run equal its solo run's bit for bit, and so does its held-out tau: every kind (DFlash, DSpark, DFlash 2 and
EAGLE-3 on tiny-llama; MTP, which needs the target's MTP layer, on tiny-qwen3-next), with packs as they come and
padded to the run's fixed shapes (trainer.pad_packs; `make test-all`). The unpadded shared runs are stopped half
way and resumed (one checkpoint holds every drafter), so each kind's resume is bit-identical to a run never
stopped. A drafter whose loss goes non-finite stops, recorded, while the other goes on."""

import functools
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
# Each target's shared run: MTP needs tiny-qwen3-next's MTP layer, beside a partner compared on tiny-llama.
SHARED = {"tiny-llama": [DFLASH, {**DFLASH, "drafter": "dspark"}, {**DFLASH, "drafter": "dflash2", "selector_rank": 16},
                         EAGLE3],
          "tiny-qwen3-next": [{"drafter": "mtp", "num_speculative_tokens": 3, "max_anchors": 16}, DFLASH]}
# kind -> the target of its solo run and of the shared run it is compared with
COMPARED_ON = {"dflash": "tiny-llama", "dspark": "tiny-llama", "dflash2": "tiny-llama", "eagle3": "tiny-llama",
               "mtp": "tiny-qwen3-next"}
STEPS = 4


@pytest.fixture(scope="module")
def data(tiny_target, cache_dir):
    """data(target name) -> (checkpoint, training rows, held-out rows), built on first use."""
    @functools.cache
    def get(name: str):
        target = tiny_target(name)
        return target, *resolve_data(DataConfig(rows=16, heldout_rows=3, prompt_tokens=60, max_new_tokens=12), target,
                                     cache_dir)

    return get


def _run(data, run_dir, entries, steps=STEPS, pad=False):
    target, train, heldout = data
    cfg = TrainerConfig(max_steps=steps, ranks=1, device="cpu", threads=1, token_budget=256, progress=False,
                        checkpoint_every=2, eval_every=0, eval_rows=2, probe_rows=0, pad_packs=pad)
    run_dir.mkdir(parents=True, exist_ok=True)
    # drafter_cfg is the `drafter` group's: unused when entries are given
    trainer = Trainer(drafter_config("dflash"), cfg, FeatureServerConfig(workers=1), run_dir, target, train, heldout,
                      entries=entries)
    return trainer.train()


def _weights(run_dir, name):
    return read_checkpoint(RunDir(run_dir).latest_checkpoint())["drafters"][name]["drafter"]


class Runs:
    """A module's runs with packs padded or not, each made on first use (so a test waits only for its own): each
    target's shared run, stopped half way and resumed when unpadded, and each kind's solo run; (run dir, metrics)."""

    def __init__(self, data, root, pad: bool):
        self.data, self.root, self.pad = data, root, pad

    @functools.cache
    def shared(self, target: str):
        run_dir, entries = self.root / target, SHARED[target]
        if not self.pad:
            _run(self.data(target), run_dir, entries, steps=STEPS // 2)
        return run_dir, _run(self.data(target), run_dir, entries, pad=self.pad)

    @functools.cache
    def solo(self, kind: str):
        entry = next(e for e in SHARED[COMPARED_ON[kind]] if e["drafter"] == kind)
        return self.root / kind, _run(self.data(COMPARED_ON[kind]), self.root / kind, [entry], pad=self.pad)


# Padded runs repeat the unpadded runs' checks on packs padded to the run's fixed shapes: make test-all only. That a
# padded pack trains as the unpadded one is tests/drafters/test_static_shapes.py's and test_compute_read.py's check.
@pytest.fixture(scope="module", params=[pytest.param(False, id="unpadded"),
                                        pytest.param(True, id="padded", marks=pytest.mark.long)])
def runs(request, data, tmp_path_factory):
    return Runs(data, tmp_path_factory.mktemp("padded" if request.param else "unpadded"), request.param)


@pytest.mark.slow
@pytest.mark.parametrize("kind", COMPARED_ON)
def test_each_drafter_of_a_shared_run_trains_as_its_solo_run(runs, kind):
    (shared_dir, metrics), (solo_dir, alone) = runs.shared(COMPARED_ON[kind]), runs.solo(kind)
    ours, theirs = _weights(shared_dir, kind), _weights(solo_dir, kind)
    assert ours.keys() == theirs.keys()
    differ = {k: float((ours[k].float() - theirs[k].float()).abs().max()) for k in ours
              if not torch.equal(ours[k], theirs[k])}
    assert not differ, differ  # bit for bit
    mine, alone = metrics["drafters"][kind], alone["drafters"][kind]
    assert mine["steps"] == alone["steps"] == STEPS and mine["stopped_early"] is None
    assert mine["tau_offline"] == alone["tau_offline"]
    assert mine["per_position_acceptance"] == alone["per_position_acceptance"]


@pytest.mark.slow
def test_a_shared_run_prefills_once_and_reports_each_drafter(runs):
    shared_dir, metrics = runs.shared("tiny-llama")
    names = [e["drafter"] for e in SHARED["tiny-llama"]]
    assert sorted(p.name for p in (shared_dir / "export").iterdir()) == sorted(names)
    # Once for the run: the prefill (every row once, whatever the drafters), and the baselines beside them.
    assert metrics["target_tokens_prefilled"] > 0 and metrics["baselines"]["bigram"]["tau"] >= 1
    # Each drafter beside baselines that draft as many tokens (blocks of 4: DFlash's and DFlash 2's K 3, DSpark's 4
    # as it drafts from the anchor too; EAGLE-3: K 7); the run's at the largest K.
    Ks = {name: metrics["drafters"][name]["baselines"]["ngram"]["K"] for name in names}
    assert Ks == {"dflash": 3, "dspark": 4, "dflash2": 3, "eagle3": 7} and metrics["baselines"]["ngram"]["K"] == 7
    assert json.loads((shared_dir / "metrics.json").read_text())["drafters"].keys() == set(names)


@pytest.mark.slow
def test_a_drafter_whose_loss_goes_non_finite_stops_and_the_others_go_on(data, tmp_path):
    target, train, heldout = data("tiny-llama")
    cfg = TrainerConfig(max_steps=4, ranks=1, device="cpu", threads=1, token_budget=1024, progress=False)
    trainer = Trainer(drafter_config("dflash"), cfg, FeatureServerConfig(workers=1), tmp_path, target, train, heldout,
                      entries=[DFLASH, EAGLE3])
    with trainer._server(trainer.rows[:3]) as server:
        from specdistill.core.batch import pack

        batch = pack(list(server), trainer.spec)
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
