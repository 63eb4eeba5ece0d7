"""HFBackend against an independent transformers forward on tiny random checkpoints of every supported family."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM, AutoModelForImageTextToText, GPT2Config, GPT2LMHeadModel, LlamaConfig, Qwen3Config,
    Qwen3MoeConfig, Qwen3NextConfig,
)
from transformers.models.qwen3_5_moe import Qwen3_5MoeConfig

from specdistill.core.contract import FeatureSpec, TokenizedRow
from specdistill.feature_server.backends import BACKENDS, build_backend
from specdistill.feature_server.hf_backend import HFBackend

REPO = str(Path(__file__).resolve().parents[2])

VOCAB, HIDDEN, LAYERS = 256, 64, 4
_DENSE = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=2,
              num_key_value_heads=1, head_dim=32, intermediate_size=96, max_position_embeddings=256)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
_HYBRID = dict(_DENSE, **_MOE, shared_expert_intermediate_size=32, linear_num_value_heads=2, linear_num_key_heads=1,
               linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
               layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"])


def _configs():
    return {
        "llama": LlamaConfig(**_DENSE),
        "qwen3": Qwen3Config(**_DENSE),
        "qwen3_moe": Qwen3MoeConfig(**_DENSE, **_MOE, decoder_sparse_step=1),
        "qwen3_next": Qwen3NextConfig(**_HYBRID),
        # The released Qwen3.5 checkpoints are text+vision composites; the backend must take the text model.
        "qwen3_5_moe": Qwen3_5MoeConfig(
            text_config=_HYBRID, vision_config=dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2,
                                                    out_hidden_size=HIDDEN)),
    }


def _save_random(config, path, dtype=torch.float32):
    torch.manual_seed(0)
    config.dtype = dtype
    cls = AutoModelForImageTextToText if config.model_type == "qwen3_5_moe" else AutoModelForCausalLM
    model = cls.from_config(config, dtype=dtype)
    with torch.no_grad():  # zero-centred norm weights (Qwen3-Next) would otherwise all be 0: make norms matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.5)
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    root = tmp_path_factory.mktemp("targets")
    return {arch: _save_random(cfg, root / arch) for arch, cfg in _configs().items()}


def _rows():
    g = torch.Generator().manual_seed(1)
    lengths = [9, 4, 13]  # different lengths in one extract call: each row must equal its own unpadded run
    return [TokenizedRow(row_id=100 + i, input_ids=tuple(torch.randint(0, VOCAB, (n,), generator=g).tolist()),
                         loss_mask=(0,) * (n // 2) + (1,) * (n - n // 2)) for i, n in enumerate(lengths)]


@torch.inference_mode()
def _reference(target_dir, hidden_TLD, input_ids):
    """A separate, plain transformers forward: embeddings, hidden_states, the final norm's input, logits, and
    the logits recomputed from our id-L states with the target's own norm + lm_head."""
    model = AutoModelForCausalLM.from_pretrained(target_dir, local_files_only=True).eval()
    seen = {}
    model.model.norm.register_forward_pre_hook(lambda mod, args: seen.__setitem__("pre_norm", args[0]))
    ids_1T = torch.tensor([input_ids])
    out = model(ids_1T, output_hidden_states=True, use_cache=False)
    return dict(embeddings_TD=model.model.embed_tokens(ids_1T)[0], hidden_states=[h[0] for h in out.hidden_states],
                pre_norm_TD=seen["pre_norm"][0], logits_TV=out.logits[0],
                ours_logits_TV=model.lm_head(model.model.norm(hidden_TLD[:, -1])))


# fp32 on CPU, same weights and inputs: only reduction-order noise is expected, hence tight tolerances.
TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", list(_configs()))
def test_layer_ids_follow_vllm_convention(targets, arch):
    spec = FeatureSpec(layer_ids=tuple(range(LAYERS + 1)), hidden_dtype="float32")
    backend = HFBackend(targets[arch], spec)
    assert (backend.num_hidden_layers, backend.hidden_size) == (LAYERS, HIDDEN)
    rows = _rows()
    hiddens = backend.extract(rows)
    assert len(hiddens) == len(rows)
    for row, hidden_TLD in zip(rows, hiddens):
        assert hidden_TLD.shape == (row.num_tokens, LAYERS + 1, HIDDEN) and hidden_TLD.dtype == torch.float32
        ref = _reference(targets[arch], hidden_TLD, row.input_ids)
        assert len(ref["hidden_states"]) == LAYERS + 1
        torch.testing.assert_close(hidden_TLD[:, 0], ref["embeddings_TD"], **TOL)
        for k in range(1, LAYERS):
            torch.testing.assert_close(hidden_TLD[:, k], ref["hidden_states"][k], **TOL, msg=f"layer id {k}")
        torch.testing.assert_close(hidden_TLD[:, LAYERS], ref["pre_norm_TD"], **TOL)
        # id L is pre-norm: norm + lm_head on it gives the target's logits, and it differs from the post-norm
        # last hidden_states entry.
        torch.testing.assert_close(ref["ours_logits_TV"], ref["logits_TV"], **TOL)
        assert not torch.allclose(hidden_TLD[:, LAYERS], ref["hidden_states"][LAYERS], atol=1e-3)


def test_subset_of_layers_and_early_stop(targets):
    full = HFBackend(targets["qwen3_next"], FeatureSpec(tuple(range(LAYERS + 1)), "float32"))
    part = HFBackend(targets["qwen3_next"], FeatureSpec((1, 2), "float32"))  # forward stops before layer 2
    row = _rows()[0]
    torch.testing.assert_close(part.extract([row])[0], full.extract([row])[0][:, 1:3], **TOL)


def test_dtype_from_checkpoint_unless_overridden(tmp_path):
    target = _save_random(LlamaConfig(**_DENSE), tmp_path / "bf16", dtype=torch.bfloat16)
    spec = FeatureSpec((0, LAYERS), "bfloat16")
    assert HFBackend(target, spec).model.dtype == torch.bfloat16
    backend = HFBackend(target, spec, dtype="float32")
    assert backend.model.dtype == torch.float32
    assert backend.extract(_rows()[:1])[0].dtype == torch.bfloat16  # output follows the spec, not the model


def test_out_of_range_layer_id_errors(targets):
    with pytest.raises(ValueError, match=rf"layer ids \[{LAYERS + 1}\] out of range.*0\.\.{LAYERS}"):
        HFBackend(targets["llama"], FeatureSpec((0, LAYERS + 1)))


def test_unsupported_architecture_errors(tmp_path):
    GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"model_type 'gpt2' is not supported.*qwen3_next"):
        HFBackend(str(tmp_path), FeatureSpec((0,)))


def test_missing_checkpoint_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        HFBackend(str(tmp_path), FeatureSpec((0,)))


def test_bad_rows_error_with_row_id(targets):
    backend = HFBackend(targets["llama"], FeatureSpec((0,)))
    with pytest.raises(ValueError, match=rf"row 5: token ids \[{VOCAB}\] outside"):
        backend.extract([TokenizedRow(5, (1, VOCAB), (0, 1))])
    with pytest.raises(ValueError, match="row 6: loss_mask has 1 entries"):
        backend.extract([TokenizedRow(6, (1, 2), (0,))])


def test_registry_errors_list_valid_names_and_hf_path_skips_vllm(targets):
    with pytest.raises(ValueError, match=r"unknown feature backend 'nope'.*'hf'"):
        build_backend("nope", targets["llama"], FeatureSpec((0,)))
    assert "hf" in BACKENDS
    # A fresh interpreter: building the HF backend must not import vllm.
    code = ("import sys; from specdistill.feature_server.backends import build_backend; from specdistill.core.contract import "
            f"FeatureSpec; build_backend('hf', {targets['llama']!r}, FeatureSpec((0,))); "
            "assert 'vllm' not in sys.modules, 'vllm imported on the hf path'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)
