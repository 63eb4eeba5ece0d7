"""Exact reference for a Qwen3-Next / Qwen3.5 sparse MoE block: the eager per-expert loop of transformers 5.

router: logits = x W_g^T; p = softmax(logits) in fp32; top-k; renormalised when norm_topk_prob; cast to x's dtype.
experts: y_t = sum_k w_tk * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = index_tk, with gate/up fused as
gate_up_proj [E, 2I, D] (gate rows first) and down_proj [E, D, I] (transformers' in-memory layout).
shared expert: sigmoid(x w_sg^T) * down(silu(gate(x)) * up(x)).

Suffixes: T tokens, D hidden, E experts, K top-k, I expert intermediate.
"""

import torch
import torch.nn.functional as F


def route(x_TD: torch.Tensor, gate_weight_ED: torch.Tensor, top_k: int, norm_topk_prob: bool = True):
    """(weights_TK in x's dtype, expert index_TK), as transformers' Qwen3NextTopKRouter."""
    logits_TE = F.linear(x_TD, gate_weight_ED)
    probs_TE = torch.softmax(logits_TE, dim=-1, dtype=torch.float)
    weights_TK, index_TK = torch.topk(probs_TE, top_k, dim=-1)
    if norm_topk_prob:
        weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True)
    return weights_TK.to(logits_TE.dtype), index_TK


def experts_loop(x_TD, index_TK, weights_TK, gate_up_proj_EHD, down_proj_EDI) -> torch.Tensor:
    """The eager per-expert loop (transformers' Qwen3NextExperts.forward)."""
    out_TD = torch.zeros_like(x_TD)
    for e in torch.unique(index_TK).tolist():
        token_idx, k_idx = torch.where(index_TK == e)
        gate, up = F.linear(x_TD[token_idx], gate_up_proj_EHD[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down_proj_EDI[e]) * weights_TK[token_idx, k_idx, None]
        out_TD = out_TD.index_add(0, token_idx, y.to(out_TD.dtype))
    return out_TD


def shared_expert(x_TD, gate_proj_ID, up_proj_ID, down_proj_DI, shared_gate_1D) -> torch.Tensor:
    mlp = F.linear(F.silu(F.linear(x_TD, gate_proj_ID)) * F.linear(x_TD, up_proj_ID), down_proj_DI)
    return torch.sigmoid(F.linear(x_TD, shared_gate_1D)) * mlp
