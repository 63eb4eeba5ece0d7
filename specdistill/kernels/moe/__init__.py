"""Sparse MoE (Qwen3-Next / Qwen3.5): grouped-GEMM fast path beside the eager per-expert reference."""

from specdistill.kernels.moe.block import SparseMoeBlock, fuse_expert_weights
from specdistill.kernels.moe.grouped import grouped_experts, quantize_fp8
from specdistill.kernels.moe.reference import experts_loop, route, shared_expert

__all__ = ["SparseMoeBlock", "experts_loop", "fuse_expert_weights", "grouped_experts", "quantize_fp8", "route",
           "shared_expert"]
