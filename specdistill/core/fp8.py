"""FP8 weights as vLLM's fp8 checkpoints store them: float8_e4m3fn with block-wise float32 `scale_inv`.

weight ~= fp8 * scale_inv, one scale per [b, b] block (Qwen / DeepSeek FP8 releases, weight_block_size in
config.json's quantization_config). The trainer reads only bf16 tensors of such a checkpoint (embeddings, norm,
lm_head) but dequantizes any FP8 one it meets; the HF feature backend lets transformers dequantize on CPU.
"""

import re

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
_QUANTIZED = re.compile(r"(^|\.)layers\.\d+\..*_proj\.weight$")


def is_quantized_name(name: str) -> bool:
    return bool(_QUANTIZED.search(name))


def quantize_blockwise(w_OI: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 weight and its [ceil(O/b), ceil(I/b)] scale_inv: each block's max |w| maps to the fp8 maximum."""
    O, I = w_OI.shape
    nO, nI = -(-O // block), -(-I // block)
    padded = torch.zeros(nO * block, nI * block, dtype=torch.float32)
    padded[:O, :I] = w_OI.float()
    blocks = padded.view(nO, block, nI, block)
    scale_inv = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)
    q = (blocks / scale_inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(nO * block, nI * block)[:O, :I].contiguous(), scale_inv


def dequantize_blockwise(q_OI: torch.Tensor, scale_inv: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    O, I = q_OI.shape
    bO, bI = -(-O // scale_inv.shape[0]), -(-I // scale_inv.shape[1])
    scale = scale_inv.float().repeat_interleave(bO, 0)[:O].repeat_interleave(bI, 1)[:, :I]
    return (q_OI.float() * scale).to(dtype)
