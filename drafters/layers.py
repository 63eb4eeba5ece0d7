"""Building blocks shared by the drafter heads: RoPE, SwiGLU MLP, the Qwen3-style attention projections.

Weight names match speculators 0.9.0 / vLLM (q_proj, k_norm, gate_proj, ...) so a state dict exports as is.
Suffixes: Q queries, K keys, H heads, d head dim, D hidden, P positions.
"""

import torch
import torch.nn.functional as F
from torch import nn

from trainer.target import RMSNorm


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
