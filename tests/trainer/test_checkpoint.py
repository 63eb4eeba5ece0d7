"""Checkpoints are atomic: a crash in the middle of a save leaves the previous checkpoint the one resumed from."""

import pytest
import torch
from torch import nn

from trainer import checkpoint
from trainer.checkpoint import TrainState, latest_checkpoint, load_checkpoint, save_checkpoint
from trainer.config import TrainerConfig
from trainer.optim import Optimizers

META = {"drafter": "dflash", "target_layer_ids": [1, 2], "model_type": "llama"}


def _parts(seed: int):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
    optimizers = Optimizers(model, TrainerConfig())
    model(torch.randn(4, 8)).sum().backward()
    optimizers.step()  # Muon and AdamW both hold state now
    return model, optimizers, torch.Generator().manual_seed(seed)


def test_a_crash_during_save_leaves_the_previous_checkpoint_usable(tmp_path, monkeypatch):
    model, optimizers, generator = _parts(0)
    save_checkpoint(tmp_path, TrainState(step=1, consumed_row_ids={3, 5}), model, optimizers, generator, META, 2)
    saved = {k: v.clone() for k, v in model.state_dict().items()}

    def dies_halfway(obj, path):
        with open(path, "wb") as f:  # what a kill -9 in the middle of torch.save leaves behind
            f.write(b"PK\x03\x04 partial")
        raise KeyboardInterrupt  # the process is going down

    with torch.no_grad():
        model[0].weight.add_(1.0)
    monkeypatch.setattr(checkpoint.torch, "save", dies_halfway)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, TrainState(step=2), model, optimizers, generator, META, 2)
    monkeypatch.undo()

    path = latest_checkpoint(tmp_path)
    assert path.name == "step_00000001.pt"  # the half-written step 2 is only ever a .tmp
    fresh, fresh_opt, fresh_gen = _parts(1)
    state = load_checkpoint(path, fresh, fresh_opt, fresh_gen, META)
    assert state.step == 1 and state.consumed_row_ids == {3, 5}
    assert all(torch.equal(saved[k], v) for k, v in fresh.state_dict().items())
    assert torch.equal(fresh_gen.get_state(), generator.get_state())


def test_a_checkpoint_of_another_setup_is_refused(tmp_path):
    model, optimizers, generator = _parts(0)
    path = save_checkpoint(tmp_path, TrainState(step=1), model, optimizers, generator, META, 2)
    with pytest.raises(ValueError, match="target_layer_ids=\\[1, 2\\].*use a new hydra.run.dir"):
        load_checkpoint(path, model, optimizers, generator, {**META, "target_layer_ids": [1, 3]})
