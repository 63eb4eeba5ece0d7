"""Bad input never becomes a wrong drafter: each kind gets a clear error naming what and where.

Covered elsewhere (kind -> test): malformed JSON, missing fields, wrong field types -> feature_server/test_dataset.py
::test_bad_rows_name_file_line_and_field; empty responses and prompts longer than the context -> counted skips,
::test_empty_and_too_long_rows_are_counted_skips; token ids >= vocab -> ::test_token_id_outside_vocab_names_the_row;
target/drafter vocab mismatch -> ::test_check_tokenizer_matches; layer ids out of range ->
feature_server/test_vllm_backend.py::test_out_of_range_layer_ids_raise_before_engine_start; config override of the
wrong type / unknown key -> test_config.py. Here: broken checkpoints, NaN/Inf hidden states, pickles.
"""

import shutil
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file, save_file

from specdistill.core.batch import pack
from specdistill.core.target import TargetHead, TargetInfo
from specdistill.feature_server.config import FeatureServerConfig
from specdistill.launch.config import DataConfig
from specdistill.launch.prepare import resolve_data
from specdistill.drafters import DRAFTERS
from specdistill.trainer.checkpoint import TrainState, load_checkpoint
from specdistill.trainer.config import TrainerConfig
from specdistill.trainer.trainer import Trainer


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_checkpoint_with_a_missing_tensor_names_it(tiny_llama_dir, tmp_path):
    target = _copy(tiny_llama_dir, tmp_path / "t")
    weights = load_file(str(target / "model.safetensors"))
    del weights["model.norm.weight"]
    save_file(weights, str(target / "model.safetensors"))
    with pytest.raises(KeyError, match=r"none of \['model.norm.weight'.*found in the checkpoint"):
        TargetHead(TargetInfo.load(target))


def test_corrupt_safetensors_file_names_the_file(tiny_llama_dir, tmp_path):
    target = _copy(tiny_llama_dir, tmp_path / "t")
    data = (target / "model.safetensors").read_bytes()
    (target / "model.safetensors").write_bytes(data[: len(data) // 3])  # a truncated download
    with pytest.raises(ValueError, match=r"model.safetensors: not a readable safetensors file"):
        TargetHead(TargetInfo.load(target))
    (target / "model.safetensors").write_bytes(b"\xff" * 64)  # not safetensors at all
    with pytest.raises(ValueError, match=r"model.safetensors: not a readable safetensors file"):
        TargetHead(TargetInfo.load(target))


class _Payload:
    """Anything a pickle could smuggle in; weights_only refuses to build it."""


def test_checkpoints_load_weights_only(tmp_path):
    path = tmp_path / "step_00000001.pt"
    torch.save({"state": {}, "drafter": {}, "evil": _Payload()}, path)
    with pytest.raises(Exception, match="Weights only load failed"):
        load_checkpoint(path, {})


@pytest.fixture(scope="module")
def small_trainer(tiny_target, cache_dir, tmp_path_factory):
    target = tiny_target("tiny-llama")
    train, heldout = resolve_data(DataConfig(rows=6, heldout_rows=2, prompt_tokens=60, max_new_tokens=8), target,
                                  cache_dir)
    drafter_cfg = DRAFTERS["dflash"][0](num_layers=1, max_anchors=32)
    trainer_cfg = TrainerConfig(max_steps=4, ranks=1, device="cpu", token_budget=512, progress=False,
                                checkpoint_every=1)
    run_dir = tmp_path_factory.mktemp("nan-run")
    return Trainer(drafter_cfg, trainer_cfg, FeatureServerConfig(workers=1), run_dir, target, train, heldout)


def _batch(trainer):
    with trainer._server(trainer.rows[:2]) as server:
        samples = [s for s in server]
    return pack([replace(s, input_ids_T=s.input_ids_T.clone(), loss_mask_T=s.loss_mask_T.clone(),
                         hidden_TLD=s.hidden_TLD.clone(), response_RLD=s.response_RLD.clone())
                 for s in samples], trainer.spec)


@pytest.mark.slow
@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_non_finite_hidden_states_stop_the_step_naming_step_and_row(small_trainer, poison):
    batch = _batch(small_trainer)
    second_row = batch.row_ids[1]
    start = int((batch.document_ids_T == 1).nonzero()[0])
    batch.hidden_TLD[start + 2, 0, 5] = poison
    before = {k: v.clone() for k, v in small_trainer.entries[0].drafter.state_dict().items()}
    state = TrainState(step=3)
    with pytest.raises(FloatingPointError, match=rf"step 4: loss is (nan|inf) on rows .*non-finite target hidden "
                                                 rf"states in rows \[{second_row}\]"):
        small_trainer._step(batch, state)
    after = small_trainer.entries[0].drafter.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # the poisoned update never happened
    assert state.step == 3 and small_trainer.run.latest_checkpoint() is None
    assert not small_trainer.run.checkpoints.exists()


def test_rows_longer_than_a_pack_are_cut_or_stop_the_run_before_training(tiny_target, cache_dir, tmp_path):
    """~70-token rows, 48-token packs: truncate=left keeps every row, cut on the left with its response whole;
    truncate=skip would skip them all, which stops the run before training, naming the count, the longest row and
    the settings to change."""
    from specdistill.data.config import DataConfig as LoadSettings

    target = tiny_target("tiny-llama")
    train, heldout = resolve_data(DataConfig(rows=6, heldout_rows=2, prompt_tokens=60, max_new_tokens=8), target,
                                  cache_dir)
    drafter_cfg = DRAFTERS["dflash"][0](num_layers=1, max_anchors=32)
    trainer_cfg = TrainerConfig(max_steps=2, ranks=1, device="cpu", token_budget=48, progress=False)
    cut = Trainer(drafter_cfg, trainer_cfg, FeatureServerConfig(workers=1), tmp_path / "a", target, train, heldout,
                  data_cfg=LoadSettings(truncate="left"), cache_dir=cache_dir)
    assert len(cut.rows) == 6 and cut.train_skips.truncated == 6 and cut.rows.num_tokens.max() == 48
    assert all(sum(r.loss_mask) >= 1 and r.loss_mask[-1] == 1 for r in cut.rows)
    with pytest.raises(ValueError, match=r"6 of 6 rows \(100.0%\) would be skipped, more than "
                                         r"data.max_skipped_fraction=0.01. The longest row is row \d+ \(\d+ tokens\) "
                                         r"and a pack holds trainer.token_budget=48 \(data.truncate=skip\)"):
        Trainer(drafter_cfg, trainer_cfg, FeatureServerConfig(workers=1), tmp_path / "b", target, train, heldout,
                data_cfg=LoadSettings(truncate="skip"), cache_dir=cache_dir)


def test_packs_hold_the_token_budget_even_past_the_targets_context(tiny_target, cache_dir, tmp_path):
    """A pack lays several rows end to end (positions restart per row), so it may exceed the target's context; only
    each row must fit the context. (Capping packs at the context halved small-real's packs: 2,048 of 4,096.)"""
    target = tiny_target("tiny-llama")  # context 4096
    train, heldout = resolve_data(DataConfig(rows=6, heldout_rows=2, prompt_tokens=60, max_new_tokens=8), target,
                                  cache_dir)
    drafter_cfg = DRAFTERS["dflash"][0](num_layers=1, max_anchors=32)
    trainer = Trainer(drafter_cfg, TrainerConfig(max_steps=2, ranks=1, device="cpu", token_budget=8192,
                                                 progress=False), FeatureServerConfig(workers=1, capacity_mb=512),
                      tmp_path / "run", target, train, heldout, cache_dir=cache_dir)
    # The engine prefills rows up to the longest one selected (its max_model_len - 1), within the context
    assert trainer.pack_tokens == 8192 and trainer.row_tokens == int(trainer.rows.num_tokens.max()) <= 4095
