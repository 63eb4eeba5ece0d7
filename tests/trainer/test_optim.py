import torch

from trainer.config import TrainerConfig
from trainer.optim import Optimizers, lr_factor


def test_schedule_warms_up_then_decays_linearly():
    cfg = TrainerConfig(max_steps=110, warmup_steps=10, final_lr_fraction=0.1)
    assert lr_factor(0, cfg) == 0.1 and lr_factor(9, cfg) == 1.0
    assert abs(lr_factor(60, cfg) - 0.55) < 1e-9 and abs(lr_factor(110, cfg) - 0.1) < 1e-9


def test_muon_takes_matrices_adamw_the_rest():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    opts = Optimizers(model, TrainerConfig())
    muon, adamw = opts.optimizers
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    assert all(p.ndim == 2 for g in muon.param_groups for p in g["params"])
    assert all(p.ndim == 1 for g in adamw.param_groups for p in g["params"])
