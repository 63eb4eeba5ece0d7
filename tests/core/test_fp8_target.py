"""FP8 targets: a tiny FP8 checkpoint made locally (vLLM's fp8 layout) is read by the trainer and the HF backend."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from specdistill.core.contract import FeatureSpec, TokenizedRow
from specdistill.core.fp8 import dequantize_blockwise, quantize_blockwise
from specdistill.core.target import TargetHead, TargetInfo
from specdistill.feature_server.hf_backend import HFBackend
from specdistill.launch.make_fp8 import make_fp8

BLOCK = 32


@pytest.fixture(scope="module")
def fp8_dir(tiny_llama_dir, tmp_path_factory):
    return make_fp8(tiny_llama_dir, tmp_path_factory.mktemp("fp8-llama"), block=BLOCK)


def test_blockwise_round_trip_error_is_within_fp8_precision():
    w = torch.randn(80, 72) * torch.logspace(-3, 1, 72)  # columns of very different scale, partial blocks
    q, scale_inv = quantize_blockwise(w, BLOCK)
    assert q.dtype == torch.float8_e4m3fn and scale_inv.shape == (3, 3)
    err = (dequantize_blockwise(q, scale_inv) - w).abs() / w.abs().clamp(min=1e-3 * w.abs().max())
    assert err.median() < 0.04  # e4m3: 3 mantissa bits -> <= 6.25% per element, ~2% typical


def test_checkpoint_layout_matches_vllm_fp8(fp8_dir):
    config = json.loads((fp8_dir / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                             "weight_block_size": [BLOCK, BLOCK]}
    with safe_open(str(fp8_dir / "model.safetensors"), framework="pt") as f:
        dtypes = {name: f.get_slice(name).get_dtype() for name in f.keys()}
    assert dtypes["model.layers.0.self_attn.q_proj.weight"] == "F8_E4M3"
    assert dtypes["model.layers.0.self_attn.q_proj.weight_scale_inv"] == "F32"
    assert dtypes["model.layers.3.mlp.down_proj.weight"] == "F8_E4M3"
    for name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
                 "model.layers.0.input_layernorm.weight"):
        assert dtypes[name] == "BF16", name


def test_trainer_reads_the_fp8_target_head_in_bf16(fp8_dir, tiny_llama_dir):
    info = TargetInfo.load(fp8_dir)
    assert info.quantization == "fp8" and TargetInfo.load(tiny_llama_dir).quantization is None
    head, source = TargetHead(info), TargetHead(TargetInfo.load(tiny_llama_dir))
    for name in ("embed_tokens.weight", "norm.weight", "lm_head.weight"):
        want = source.state_dict()[name].to(torch.bfloat16).float()
        assert torch.equal(head.state_dict()[name], want), name


def test_hf_backend_features_equal_the_dequantized_weights(fp8_dir, tiny_llama_dir):
    """transformers dequantizes on CPU; its states must match a model built from our own dequantization."""
    spec = FeatureSpec(layer_ids=(1, 2, 3), hidden_dtype="float32")  # HF states 1..3 (4 is post-norm)
    row = TokenizedRow(0, tuple(range(3, 40)), (0,) * 30 + (1,) * 7)
    got = HFBackend(str(fp8_dir), spec, dtype="float32").extract([row])[0]

    weights = load_file(str(fp8_dir / "model.safetensors"))
    state = {n: (dequantize_blockwise(t, weights[f"{n}_scale_inv"]) if t.dtype == torch.float8_e4m3fn else t.float())
             for n, t in weights.items() if not n.endswith("_scale_inv")}
    config = AutoConfig.from_pretrained(tiny_llama_dir)
    ref = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    ref.load_state_dict(state, strict=False)
    with torch.no_grad():
        hidden = ref(torch.tensor([row.input_ids]), output_hidden_states=True).hidden_states
    want = torch.stack([hidden[i][0] for i in spec.layer_ids], dim=1)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)  # their dequantized weights are bf16
    fp32 = HFBackend(str(tiny_llama_dir), spec, dtype="float32").extract([row])[0]
    rel = (got - fp32).norm() / fp32.norm()
    assert 0 < rel < 0.1  # quantized: close to the source model, not equal to it


def test_fp8_tensor_without_scale_is_a_clear_error(fp8_dir, tmp_path):
    weights = load_file(str(fp8_dir / "model.safetensors"))
    q, _ = quantize_blockwise(weights["lm_head.weight"].float(), BLOCK)
    weights["lm_head.weight"] = q  # lm_head quantized, and its scale left out
    for f in fp8_dir.iterdir():
        if f.name != "model.safetensors":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="lm_head.weight is torch.float8_e4m3fn but the checkpoint has no "
                                         "lm_head.weight_scale_inv"):
        TargetHead(TargetInfo.load(tmp_path))
    weights["lm_head.weight_scale_inv"] = quantize_blockwise(load_file(str(fp8_dir / "model.safetensors"))
                                                             ["lm_head.weight"].float(), BLOCK)[1]
    save_file(weights, str(tmp_path / "model.safetensors"))
    head = TargetHead(TargetInfo.load(tmp_path))  # with its scale, a quantized lm_head is dequantized
    source = load_file(str(fp8_dir / "model.safetensors"))["lm_head.weight"].float()
    assert (head.lm_head.weight - source).norm() / source.norm() < 0.05
