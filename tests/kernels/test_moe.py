"""Grouped-GEMM MoE equals the eager per-expert loop (values and gradients) and loads transformers' weights."""

import pytest
import torch
from transformers import Qwen3NextConfig
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock

from specdistill.kernels.moe.grouped import plan_rows
from specdistill.kernels.moe import SparseMoeBlock, experts_loop, fuse_expert_weights, grouped_experts, quantize_fp8, route

E, D, I, K, T = 8, 32, 16, 3, 96  # dims multiple of 8: grouped_mm needs 16-byte aligned strides

# Tolerances, relative to each tensor's max magnitude: fp32 differs only by summation order (~1e-6);
# bf16 rounds every GEMM output (8 mantissa bits, ~4e-3) and the paths round at different points.
REL_TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


def assert_rel_close(actual, expected, dtype, what):
    err = (actual.float() - expected.float()).abs().max() / expected.float().abs().max().clamp(min=1e-12)
    assert err <= REL_TOL[dtype], f"{what}: relative error {err:.2e} > {REL_TOL[dtype]:.0e} ({dtype})"


def expert_inputs(dtype, seed=0, I=I):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g).to(dtype).requires_grad_()
    weights, index = route(x.detach(), torch.randn(E, D, generator=g).to(dtype), K)
    weights = weights.detach().requires_grad_()
    gate_up = (torch.randn(E, 2 * I, D, generator=g) * 0.2).to(dtype).requires_grad_()
    down = (torch.randn(E, D, I, generator=g) * 0.2).to(dtype).requires_grad_()
    return x, index, weights, gate_up, down, torch.randn(T, D, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["padded", "grouped", "auto"])
@pytest.mark.parametrize("inter", [I, 8])  # 8: hidden 32 > 2 x intermediate, as Qwen3.5-35B-A3B's 2048 > 2 x 512
def test_grouped_experts_equal_eager_loop(dtype, layout, inter):
    x, index, weights, gate_up, down, g = expert_inputs(dtype, I=inter)
    leaves = (x, weights, gate_up, down)
    ref = experts_loop(x, index, weights, gate_up, down)
    ours = grouped_experts(x, index, weights, gate_up, down, layout=layout)
    assert_rel_close(ours, ref, dtype, "output")
    for name, a, b in zip(("dx", "dweights", "dgate_up", "ddown"), torch.autograd.grad(ref, leaves, g),
                          torch.autograd.grad(ours, leaves, g)):
        assert_rel_close(b, a, dtype, name)


def test_skewed_routing_and_unused_experts():
    x, _, weights, gate_up, down, g = expert_inputs(torch.float32, seed=1)
    index = torch.randperm(E)[:K].repeat(T, 1)
    index[: T // 4] = torch.tensor([3, 1, 6])  # a quarter of tokens on experts 3, 1, 6: padding would cost ~2x
    assert plan_rows(index, E, "auto")[1] == "grouped"
    ref = experts_loop(x, index, weights, gate_up, down)
    ours = grouped_experts(x, index, weights, gate_up, down)
    assert_rel_close(ours, ref, torch.float32, "output")
    only_two = index % 2  # experts 2..7 get no tokens: their weight gradients must be exactly zero
    d_gu = torch.autograd.grad(grouped_experts(x, only_two, weights, gate_up, down, layout="padded"), gate_up, g)[0]
    assert d_gu[2:].abs().max() == 0 and d_gu[:2].abs().max() > 0


def hf_block(seed=0, dtype=torch.float32):
    cfg = Qwen3NextConfig(hidden_size=D, num_experts=E, num_experts_per_tok=K, moe_intermediate_size=I,
                          shared_expert_intermediate_size=24, norm_topk_prob=True)
    torch.manual_seed(seed)
    block = Qwen3NextSparseMoeBlock(cfg)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return cfg, block.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_matches_transformers_qwen3_next(dtype):
    cfg, hf = hf_block(dtype=dtype)
    ours = SparseMoeBlock.from_config(cfg).to(dtype)
    ours.load_state_dict(hf.state_dict())  # same keys and shapes, strict
    x = torch.randn(2, T // 2, D, dtype=dtype)
    with torch.no_grad():
        expected = hf(x)
        assert_rel_close(ours(x, impl="reference"), expected, dtype, "reference vs transformers")
        assert_rel_close(ours(x), expected, dtype, "grouped vs transformers")


def test_block_parameter_gradients_match_reference():
    cfg, hf = hf_block(seed=2)
    ours = SparseMoeBlock.from_config(cfg)
    ours.load_state_dict(hf.state_dict())
    x = torch.randn(T, D, requires_grad=True)
    g = torch.randn(T, D)
    params = [x, *ours.parameters()]
    ref = torch.autograd.grad(ours(x, impl="reference"), params, g)
    fast = torch.autograd.grad(ours(x, impl="grouped"), params, g)
    names = ["x", *(n for n, _ in ours.named_parameters())]
    for name, a, b in zip(names, ref, fast):
        assert_rel_close(b, a, torch.float32, name)


@pytest.mark.parametrize("impl", ["grouped", "reference"])
def test_block_trains_under_bf16_autocast_over_fp32_weights(impl):
    """The trainer's GPU precision (bf16 autocast, fp32 master weights): the block computes in bf16 (grouped_mm is
    on no autocast list, so its casts are explicit) and every fp32 parameter gets an fp32 gradient close to the
    all-fp32 one."""
    cfg, hf = hf_block(seed=3)
    ours = SparseMoeBlock.from_config(cfg)
    ours.load_state_dict(hf.state_dict())
    x, g = torch.randn(T, D, requires_grad=True), torch.randn(T, D)
    params = [x, *ours.parameters()]
    expected = torch.autograd.grad(ours(x, impl="reference"), params, g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = ours(x, impl=impl)
    assert out.dtype == torch.bfloat16
    actual = torch.autograd.grad(out, params, g)
    names = ["x", *(n for n, _ in ours.named_parameters())]
    for name, a, b in zip(names, actual, expected):
        assert a.dtype == torch.float32, name
        assert_rel_close(a, b, torch.bfloat16, name)


def test_fuse_per_expert_checkpoint_layout():
    cfg, hf = hf_block(seed=3)
    sd = {f"mtp.layers.0.mlp.{k}": v for k, v in hf.state_dict().items()}
    on_disk = {k: v for k, v in sd.items() if ".experts." not in k}
    gu, dn = hf.experts.gate_up_proj.detach(), hf.experts.down_proj.detach()
    for e in range(E):
        on_disk[f"mtp.layers.0.mlp.experts.{e}.gate_proj.weight"] = gu[e, :I]
        on_disk[f"mtp.layers.0.mlp.experts.{e}.up_proj.weight"] = gu[e, I:]
        on_disk[f"mtp.layers.0.mlp.experts.{e}.down_proj.weight"] = dn[e]
    fused = fuse_expert_weights(on_disk)
    assert fused.keys() == sd.keys()
    assert all(torch.equal(fused[k], sd[k]) for k in sd)


def test_fp8_stored_experts_upcast_per_group():
    """fp8 weights + per-row scales give the same result as the dequantised bf16 weights in the eager loop."""
    x, index, weights, gate_up, down, g = expert_inputs(torch.bfloat16, seed=4)
    gu8, gu_scale = quantize_fp8(gate_up.detach())
    dn8, dn_scale = quantize_fp8(down.detach())
    assert gu8.dtype == torch.float8_e4m3fn
    deq_gu = (gu8.float() * gu_scale[..., None]).to(torch.bfloat16)
    deq_dn = (dn8.float() * dn_scale[..., None]).to(torch.bfloat16)
    assert_rel_close(deq_gu, gate_up.detach(), torch.bfloat16, "fp8 round trip")  # e4m3: 3 mantissa bits
    for layout in ("padded", "grouped"):
        ref = experts_loop(x, index, weights, deq_gu, deq_dn)
        ours = grouped_experts(x, index, weights, gu8, dn8, gu_scale, dn_scale, layout=layout)
        assert_rel_close(ours, ref, torch.bfloat16, f"fp8 {layout} output")
        dx_ref, dw_ref = torch.autograd.grad(ref, (x, weights), g)
        dx, dw = torch.autograd.grad(ours, (x, weights), g)
        assert_rel_close(dx, dx_ref, torch.bfloat16, f"fp8 {layout} dx")
        assert_rel_close(dw, dw_ref, torch.bfloat16, f"fp8 {layout} dweights")


def test_fp8_weights_need_scales():
    x, index, weights, gate_up, down, _ = expert_inputs(torch.bfloat16)
    with pytest.raises(ValueError, match="scales"):
        grouped_experts(x, index, weights, gate_up.detach().to(torch.float8_e4m3fn), down)
