"""Initialise a drafter's decoder layers from the target's own top layers.

A DFlash-family layer has the target's attention geometry and MLP width by default, so the target's last
decoder layers fit it tensor for tensor. Starting there, the drafter begins as "the rest of the target" applied to
the target's own states instead of as noise (speculators and z-lab initialise what they can from the verifier too:
embeddings, lm_head). Tensors whose name or shape has no counterpart (a gated q_proj, q_norm/k_norm on a Llama
target) keep their fresh init. Norm weights are converted from the target's convention: x * (1 + w) targets
(Qwen3-Next / Qwen3.5) store w zero-centred, the drafter's plain RMSNorm stores 1 + w.
"""

import logging

import torch
from torch import nn

from specdistill.core.target import TargetInfo, read_tensor

log = logging.getLogger(__name__)

# drafter-layer tensor name -> the target decoder layer's name for it (under model.layers.<i>.)
LAYER_TENSORS = {
    "self_attn.q_proj.weight": "self_attn.q_proj.weight",
    "self_attn.k_proj.weight": "self_attn.k_proj.weight",
    "self_attn.v_proj.weight": "self_attn.v_proj.weight",
    "self_attn.o_proj.weight": "self_attn.o_proj.weight",
    "self_attn.q_norm.weight": "self_attn.q_norm.weight",
    "self_attn.k_norm.weight": "self_attn.k_norm.weight",
    "mlp.gate_proj.weight": "mlp.gate_proj.weight",
    "mlp.up_proj.weight": "mlp.up_proj.weight",
    "mlp.down_proj.weight": "mlp.down_proj.weight",
    "input_layernorm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "post_attention_layernorm.weight",
}


def source_layers(num_hidden_layers: int, num_drafter_layers: int) -> list[int]:
    """The target's last num_drafter_layers decoder layers (all of them, repeated from the top, if it has fewer)."""
    return [max(0, num_hidden_layers - num_drafter_layers + j) for j in range(num_drafter_layers)]


@torch.no_grad()
def init_layers_from_target(layers: nn.ModuleList, target: TargetInfo) -> dict[str, int]:
    """Copy what fits from the target's top layers into `layers`; returns {"copied": n, "kept": m} tensor counts."""
    copied = kept = 0
    for layer, src in zip(layers, source_layers(target.num_hidden_layers, len(layers))):
        params = dict(layer.named_parameters())
        for name, target_name in LAYER_TENSORS.items():
            if name not in params:
                continue
            tensor = read_tensor(target, f"layers.{src}.{target_name}")
            if tensor is None or tensor.shape != params[name].shape:
                kept += 1
                continue
            tensor = tensor.float()
            if name.endswith("norm.weight") and target.zero_centred_norm:
                tensor = tensor + 1.0
            params[name].copy_(tensor)
            copied += 1
    log.info("drafter layers initialised from target layers %s: %d tensors copied, %d kept fresh",
             source_layers(target.num_hidden_layers, len(layers)), copied, kept)
    return {"copied": copied, "kept": kept}
