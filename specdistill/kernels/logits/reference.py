"""Naive references for response-only losses: full [M, V] logits, then the loss, autograd for gradients.

CE to hard labels (ignore_index -100 gives 0), KL(target || draft) = sum_v p_t (log p_t - log q), and
TV = 0.5 * sum_v |p_t - q|, each per position [M]; q = softmax(h W^T), p_t = softmax(h_t W_t^T) in fp32.
Suffixes: M loss positions, D hidden, V vocab.
"""

import torch
import torch.nn.functional as F


def logits(hidden_MD: torch.Tensor, weight_VD: torch.Tensor) -> torch.Tensor:
    return F.linear(hidden_MD, weight_VD).float()


def ce_reference(hidden_MD, weight_VD, labels_M, ignore_index: int = -100) -> torch.Tensor:
    return F.cross_entropy(logits(hidden_MD, weight_VD), labels_M, reduction="none", ignore_index=ignore_index)


def kl_reference(hidden_MD, weight_VD, target_hidden_MD, target_weight_VD) -> torch.Tensor:
    logq = torch.log_softmax(logits(hidden_MD, weight_VD), -1)
    logp = torch.log_softmax(logits(target_hidden_MD, target_weight_VD), -1).detach()
    return (logp.exp() * (logp - logq)).sum(-1)


def tv_reference(hidden_MD, weight_VD, target_hidden_MD, target_weight_VD) -> torch.Tensor:
    q = torch.softmax(logits(hidden_MD, weight_VD), -1)
    p = torch.softmax(logits(target_hidden_MD, target_weight_VD), -1).detach()
    return 0.5 * (p - q).abs().sum(-1)
