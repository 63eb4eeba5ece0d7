import pytest
import torch

from specdistill.core.target import TargetInfo
from specdistill.drafters.dflash2 import DFlash2Config, DFlash2Drafter
from specdistill.drafters.dspark import DSparkConfig, DSparkDrafter
from specdistill.trainer.config import TrainerConfig
from specdistill.trainer.optim import Optimizers, lr_factor


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


@pytest.mark.parametrize("scope", ["hidden", "all"])
def test_token_tables_heads_and_dynamic_gates_go_to_adamw(tiny_llama_dir, scope):
    """muon_scope=hidden: DFlash 2's selector codebooks and convolution projections, DSpark's Markov table and
    heads are AdamW's; every hidden-layer matrix stays Muon's. muon_scope=all: Muon takes every matrix."""
    info = TargetInfo.load(tiny_llama_dir)
    cfg = TrainerConfig(muon_scope=scope)
    small = dict(num_layers=2, target_layer_ids=[1, 2, 3], sliding_window=None, max_anchors=64)
    for drafter, expected in (
            (DFlash2Drafter(DFlash2Config(**small, selector_rank=16), info, 3),
             {"candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook",
              *(f"layers.{i}.{c}_conv.kernel_projection.weight" for i in range(2) for c in ("attention", "mlp"))}),
            (DSparkDrafter(DSparkConfig(**small), info, 3),
             {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "confidence_head.proj.weight"})):
        muon, adamw = Optimizers(drafter, cfg).optimizers
        names = {id(p): n for n, p in drafter.named_parameters()}
        in_muon = {names[id(p)] for g in muon.param_groups for p in g["params"]}
        in_adamw_2d = {names[id(p)] for g in adamw.param_groups for p in g["params"] if p.ndim == 2}
        matrices = {n for n, p in drafter.named_parameters() if p.ndim == 2 and p.requires_grad}
        if scope == "hidden":
            assert in_adamw_2d == expected and in_muon == matrices - expected
            assert "layers.0.self_attn.q_proj.weight" in in_muon
        else:
            assert in_adamw_2d == set() and in_muon == matrices


def test_an_unknown_muon_scope_is_an_error():
    with pytest.raises(ValueError, match="trainer.muon_scope='some'"):
        Optimizers(torch.nn.Linear(4, 4), TrainerConfig(muon_scope="some"))


def test_muon_on_cpu_is_torchs_iteration_in_fp32():
    """Off CUDA the orthogonalisation runs in fp32 (torch's bf16 addmm is slow on CPUs without bf16 units): the
    same quintic iteration as torch.optim.Muon, so the two agree to bf16 precision, and the fp32 result is the
    more orthogonal one (its singular values stay in Newton-Schulz's band around 1)."""
    from torch.optim._muon import _zeropower_via_newtonschulz

    from specdistill.trainer.optim import newton_schulz_fp32

    g = torch.randn(96, 40, generator=torch.Generator().manual_seed(0))
    coeffs = (3.4445, -4.7750, 2.0315)
    ours, torchs = newton_schulz_fp32(g, coeffs, 5, 1e-7), _zeropower_via_newtonschulz(g, coeffs, 5, 1e-7)
    assert ours.dtype == torch.float32 and ours.shape == g.shape
    assert (ours - torchs.float()).abs().max() < 2e-2
    s = torch.linalg.svdvals(ours)
    assert s.min() > 0.5 and s.max() < 1.5


def test_cpu_muon_step_moves_each_matrix_by_its_orthogonalised_update():
    """Against two references that share no code with ours: torch.optim.Muon itself (its bf16 Newton-Schulz), and
    the exact orthogonal factor U V^T of the gradient, which the quintic iteration approximates."""
    from specdistill.trainer.optim import GatheredMuon

    torch.manual_seed(0)
    settings = dict(lr=0.1, weight_decay=0.0, momentum=0.0, nesterov=False, adjust_lr_fn="match_rms_adamw")
    w = torch.nn.Parameter(torch.randn(8, 5))
    ref = torch.nn.Parameter(w.detach().clone())
    w.grad = torch.randn(8, 5)
    ref.grad = w.grad.clone()
    before = w.detach().clone()
    GatheredMuon([w], **settings).step()
    torch.optim.Muon([ref], **settings).step()
    # bf16 iterations vs fp32 ones: entries of the ~0.06-scale update agree to a few bf16 steps
    torch.testing.assert_close(w.detach(), ref.detach(), rtol=0, atol=2e-3)
    step = (before - w.detach()) / (0.1 * 0.2 * 8**0.5)
    u, _, vh = torch.linalg.svd(ref.grad, full_matrices=False)
    cos = torch.nn.functional.cosine_similarity(step.flatten(), (u @ vh).flatten(), dim=0)
    singular = torch.linalg.svdvals(step)
    assert cos > 0.95 and singular.min() > 0.6 and singular.max() < 1.25, (cos, singular)


def test_gradients_that_are_not_finite_are_dropped_without_a_step():
    """Clipping an inf gradient's norm would spread nan into every weight: no step, the gradients zeroed, False."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    optimizers = Optimizers(model, TrainerConfig())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model(torch.randn(2, 4)).sum().backward()
    model[0].weight.grad[0, 0] = float("inf")
    assert not optimizers.clip_step_and_zero(model.parameters(), 1.0)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    assert not optimizers.clip_step_and_zero(model.parameters(), 1.0, agree=lambda finite: False)  # another rank's
    model(torch.randn(2, 4)).sum().backward()
    assert optimizers.clip_step_and_zero(model.parameters(), 1.0)
    assert not torch.equal(before["0.weight"], model[0].weight)


def test_ranks_share_newton_schulz_by_flops_the_same_way_everywhere():
    """The DFlash family's Muon matrices at the production geometry (5 layers of q, k, v, o, gate, up, down; fc):
    the busiest of 2 ranks does 50.8% of the 14.4 TFLOP, of 4 ranks 25.7%; equal costs alternate from rank 0 (the
    assignment depends on the shapes alone, so every rank derives the same one)."""
    from specdistill.trainer.optim import assign_owners, newton_schulz_flops

    layer = [(4096, 2048), (512, 2048), (512, 2048), (2048, 4096), (6144, 2048), (6144, 2048), (2048, 6144)]
    costs = [newton_schulz_flops(shape, 5) for shape in layer * 5 + [(2048, 10240)]]
    assert sum(costs) == pytest.approx(14.38e12, rel=1e-3)
    for ranks, busiest in ((2, 0.508), (4, 0.257)):
        owners = assign_owners(costs, ranks)
        loads = [sum(c for c, o in zip(costs, owners) if o == r) for r in range(ranks)]
        assert max(loads) / sum(costs) == pytest.approx(busiest, abs=1e-3)
    assert assign_owners([1.0] * 5, 2) == [0, 1, 0, 1, 0]


def test_shard_rows_are_fsdps_row_shards():
    """FSDP2's Shard(0) cuts a matrix's rows as torch.chunk does: ceil(rows / ranks) each, the last shorter or
    empty (5 rows on 4 ranks: 2, 2, 1, 0)."""
    from specdistill.trainer.optim import shard_rows

    for rows in range(12):
        for ranks in range(1, 6):
            chunks = [len(c) for c in torch.arange(rows).chunk(ranks)] if rows else []
            assert shard_rows(rows, ranks) == chunks + [0] * (ranks - len(chunks)), (rows, ranks)


def test_torchs_newton_schulz_reads_its_input_in_bf16():
    """Why the split Muon may send updates in bf16 on CUDA (optim.exchange_dtype): torch's iteration casts its input
    to bf16 before anything else, so an fp32 update and its bf16 cast give the same result bit for bit."""
    from torch.optim._muon import _zeropower_via_newtonschulz

    g = torch.randn(24, 40, generator=torch.Generator().manual_seed(0))
    coeffs = (3.4445, -4.7750, 2.0315)
    assert torch.equal(_zeropower_via_newtonschulz(g, coeffs, 5, 1e-7),
                       _zeropower_via_newtonschulz(g.bfloat16(), coeffs, 5, 1e-7))
