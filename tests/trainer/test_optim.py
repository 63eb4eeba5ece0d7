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


def test_muon_on_cpu_is_torchs_iteration_in_fp32():
    """Off CUDA the orthogonalisation runs in fp32 (torch's bf16 addmm is slow on CPUs without bf16 units): the
    same quintic iteration as torch.optim.Muon, so the two agree to bf16 precision, and the fp32 result is the
    more orthogonal one (its singular values stay in Newton-Schulz's band around 1)."""
    from torch.optim._muon import _zeropower_via_newtonschulz

    from trainer.optim import newton_schulz_fp32

    g = torch.randn(96, 40, generator=torch.Generator().manual_seed(0))
    coeffs = (3.4445, -4.7750, 2.0315)
    ours, torchs = newton_schulz_fp32(g, coeffs, 5, 1e-7), _zeropower_via_newtonschulz(g, coeffs, 5, 1e-7)
    assert ours.dtype == torch.float32 and ours.shape == g.shape
    assert (ours - torchs.float()).abs().max() < 2e-2
    s = torch.linalg.svdvals(ours)
    assert s.min() > 0.5 and s.max() < 1.5


def test_cpu_muon_step_moves_each_matrix_by_its_orthogonalised_update():
    from trainer.optim import GatheredMuon, newton_schulz_fp32

    w = torch.nn.Parameter(torch.randn(8, 5))
    w.grad = torch.randn(8, 5)
    before, grad = w.detach().clone(), w.grad.clone()
    GatheredMuon([w], lr=0.1, weight_decay=0.0, momentum=0.0, nesterov=False, adjust_lr_fn="match_rms_adamw").step()
    expected = before - 0.1 * 0.2 * 8**0.5 * newton_schulz_fp32(grad, (3.4445, -4.7750, 2.0315), 5, 1e-7)
    assert torch.allclose(w.detach(), expected, atol=1e-6)
