"""Building blocks shared by the drafter heads: RoPE, SwiGLU MLP, the Qwen3-style attention projections, the
layer geometry, its speculators config entry and the weight init.

Weight names match speculators 0.9.0 / vLLM (q_proj, k_norm, gate_proj, ...) so a state dict exports as is.
Suffixes: Q queries, K keys, H heads, d head dim, D hidden, P positions.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specdistill.core.target import RMSNorm, TargetInfo


@dataclass(frozen=True)
class LayerShape:
    """A Qwen3-style decoder layer's geometry."""

    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    eps: float

    @classmethod
    def of(cls, cfg, target: TargetInfo) -> "LayerShape":
        """From a drafter config's num_attention_heads, num_key_value_heads, head_dim, intermediate_size (None:
        the target's; a pure-MoE target has no dense width, then 3 x hidden) and rms_norm_eps."""
        return cls(
            hidden=target.hidden_size,
            num_heads=cfg.num_attention_heads or target.num_attention_heads,
            num_kv_heads=cfg.num_key_value_heads or target.num_key_value_heads,
            head_dim=cfg.head_dim or target.head_dim,
            intermediate=cfg.intermediate_size or target.intermediate_size or 3 * target.hidden_size,
            eps=cfg.rms_norm_eps,
        )


def speculators_layer_config(shape: LayerShape, target: TargetInfo, num_layers: int, rope_theta: float,
                             layer_type: str = "full_attention") -> dict:
    """The `transformer_layer_config` of a speculators config.json: num_layers Qwen3 decoder layers of `shape`,
    all of `layer_type` (full_attention, or sliding_attention with the window added by the caller). vLLM builds
    them as its Qwen3 layers (Eagle3Qwen3ForCausalLM for EAGLE-3); speculators as its qwen3 layers."""
    return {
        "model_type": "qwen3",
        "vocab_size": target.vocab_size,
        "hidden_size": target.hidden_size,
        "intermediate_size": shape.intermediate,
        "num_hidden_layers": num_layers,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": shape.eps,
        "attention_bias": False,
        "max_position_embeddings": target.max_position_embeddings,
        "rope_parameters": {"rope_theta": rope_theta, "rope_type": "default"},
        "use_sliding_window": layer_type == "sliding_attention",
        "layer_types": [layer_type] * num_layers,
        "tie_word_embeddings": False,
    }


def layer_geometry(layer_config: dict) -> dict:
    """The drafter config fields a `transformer_layer_config` fixes (the inverse of speculators_layer_config)."""
    rope = layer_config.get("rope_parameters") or {}
    return {"num_attention_heads": layer_config["num_attention_heads"],
            "num_key_value_heads": layer_config["num_key_value_heads"], "head_dim": layer_config["head_dim"],
            "intermediate_size": layer_config["intermediate_size"], "rms_norm_eps": layer_config["rms_norm_eps"],
            "rope_theta": float(rope.get("rope_theta") or layer_config.get("rope_theta"))}


def init_linear(module: nn.Module) -> None:
    """Fresh Linear weights ~ N(0, 0.02), biases left as built (`module.apply(init_linear)`)."""
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, std=0.02)


class Rotary(nn.Module):
    """Default (unscaled) RoPE, as transformers' `rope_type: default` with rotate_half."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions_P: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions_P.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)  # [P, d]
        return emb.cos(), emb.sin()


def apply_rotary(x_PHd: torch.Tensor, cos_Pd: torch.Tensor, sin_Pd: torch.Tensor) -> torch.Tensor:
    half = x_PHd.shape[-1] // 2
    rotated = torch.cat([-x_PHd[..., half:], x_PHd[..., :half]], dim=-1)
    return (x_PHd * cos_Pd[:, None].to(x_PHd.dtype)) + (rotated * sin_Pd[:, None].to(x_PHd.dtype))


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class QKVProjections(nn.Module):
    """q/k/v/o projections with per-head q_norm/k_norm (Qwen3 attention), no attention kernel."""

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, eps: float):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5
        self.q_proj = nn.Linear(hidden, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden, bias=False)
        self.q_norm = RMSNorm(head_dim, eps)
        self.k_norm = RMSNorm(head_dim, eps)

    def queries(self, x_QD: torch.Tensor) -> torch.Tensor:
        return self.q_norm(self.q_proj(x_QD).view(x_QD.shape[0], self.num_heads, self.head_dim))

    def keys_values(self, x_KD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (x_KD.shape[0], self.num_kv_heads, self.head_dim)
        return self.k_norm(self.k_proj(x_KD).view(shape)), self.v_proj(x_KD).view(shape)
