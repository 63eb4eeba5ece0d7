"""A Qwen3-Next / Qwen3.5 sparse MoE block whose state dict is transformers' Qwen3NextSparseMoeBlock's.

Keys: gate.weight [E, D], experts.gate_up_proj [E, 2I, D], experts.down_proj [E, D, I],
shared_expert.{gate,up}_proj.weight [Is, D], shared_expert.down_proj.weight [D, Is], shared_expert_gate.weight [1, D].
So `block.load_state_dict(hf_block.state_dict())` works, and a target checkpoint's `mtp.layers.0.mlp.*` tensors
load after `fuse_expert_weights` (checkpoints on disk keep one gate/up/down tensor per expert).
Computation runs in x's dtype (fp32 master weights are cast once per call, autograd-tracked).
"""

import re

import torch
from torch import nn

from specdistill.kernels.moe.grouped import grouped_experts
from specdistill.kernels.moe.reference import experts_loop, route, shared_expert

IMPLS = ("auto", "grouped", "reference")


class Router(nn.Module):
    def __init__(self, hidden: int, num_experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden))


class Experts(nn.Module):
    def __init__(self, hidden: int, num_experts: int, intermediate: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))


class SharedExpert(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)


class SparseMoeBlock(nn.Module):
    def __init__(self, hidden: int, num_experts: int, top_k: int, intermediate: int, shared_intermediate: int,
                 norm_topk_prob: bool = True, impl: str = "auto"):
        super().__init__()
        if impl not in IMPLS:
            raise ValueError(f"MoE impl {impl!r} is not one of {IMPLS}")
        self.top_k, self.norm_topk_prob, self.impl = top_k, norm_topk_prob, impl
        self.gate = Router(hidden, num_experts)
        self.experts = Experts(hidden, num_experts, intermediate)
        self.shared_expert = SharedExpert(hidden, shared_intermediate)
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)
        for p in (self.experts.gate_up_proj, self.experts.down_proj):
            nn.init.normal_(p, std=0.02)

    @classmethod
    def from_config(cls, config, impl: str = "auto") -> "SparseMoeBlock":
        """From a transformers Qwen3NextConfig / Qwen3_5MoeTextConfig."""
        return cls(config.hidden_size, config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size,
                   config.shared_expert_intermediate_size, config.norm_topk_prob, impl)

    def forward(self, x: torch.Tensor, impl: str | None = None) -> torch.Tensor:
        """x [..., D] -> [..., D]; impl overrides the block's ("grouped" fast path, "reference" eager loop)."""
        impl = impl or self.impl
        device = x.device.type
        # Under autocast (the trainer's bf16 over fp32 master weights) the block computes in the autocast dtype, as
        # an nn.Linear would; its casts are explicit, since grouped_mm is not on autocast's lists.
        dt = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
        x_TD = x.reshape(-1, x.shape[-1]).to(dt)
        with torch.autocast(device, enabled=False):
            weights_TK, index_TK = route(x_TD, self.gate.weight.to(dt), self.top_k, self.norm_topk_prob)
            gate_up, down = self.experts.gate_up_proj.to(dt), self.experts.down_proj.to(dt)
            if impl == "reference":
                routed = experts_loop(x_TD, index_TK, weights_TK, gate_up, down)
            else:
                routed = grouped_experts(x_TD, index_TK, weights_TK, gate_up, down)
            se = self.shared_expert
            shared = shared_expert(x_TD, se.gate_proj.weight.to(dt), se.up_proj.weight.to(dt),
                                   se.down_proj.weight.to(dt), self.shared_expert_gate.weight.to(dt))
        return (routed + shared).view(x.shape)


_PER_EXPERT = re.compile(r"^(.*)experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def fuse_expert_weights(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint layout (experts.{e}.{gate,up,down}_proj.weight) -> experts.gate_up_proj / experts.down_proj.

    Keys already fused pass through, so this is safe on either layout."""
    out, per = {}, {}
    for key, value in state_dict.items():
        m = _PER_EXPERT.match(key)
        if m:
            per.setdefault(m.group(1), {}).setdefault(m.group(3), {})[int(m.group(2))] = value
        else:
            out[key] = value
    for prefix, parts in per.items():
        n = len(parts["gate_proj"])
        if any(sorted(parts[p]) != list(range(n)) for p in ("gate_proj", "up_proj", "down_proj")):
            raise ValueError(f"{prefix}experts.*: expert ids must be 0..{n - 1} for each of gate/up/down_proj")
        gate = torch.stack([parts["gate_proj"][e] for e in range(n)])
        up = torch.stack([parts["up_proj"][e] for e in range(n)])
        out[f"{prefix}experts.gate_up_proj"] = torch.cat([gate, up], dim=1)
        out[f"{prefix}experts.down_proj"] = torch.stack([parts["down_proj"][e] for e in range(n)])
    return out
