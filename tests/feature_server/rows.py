"""What the feature-server tests share: a tiny Llama's geometry, the spec they extract, small tokenized rows."""

import torch

from specdistill.core.contract import FeatureSpec, TokenizedRow

VOCAB, HIDDEN, LAYERS = 128, 32, 2
SPEC = FeatureSpec(layer_ids=(0, 1, LAYERS), hidden_dtype="float32")


def fp8_bound(x_NLD: torch.Tensor) -> torch.Tensor:
    """[N, L, D] the most an e4m3 round trip (core/contract.py quantise_fp8) may move each value of x: 2^-4 |x| (half
    an ulp of 3 mantissa bits) where x / s is a normal e4m3 value, 2^-10 s (half the subnormal step) below, s = the
    amax of x's [position, layer] / 448; times 1 + 1e-6 for fp32's own rounding of x / s * s."""
    s_NL1 = x_NLD.abs().amax(-1, keepdim=True) / 448
    return torch.maximum(x_NLD.abs() * 2**-4, s_NL1 * 2**-10) * (1 + 1e-6)


def make_rows(n: int, first_id: int = 1000) -> list[TokenizedRow]:
    g = torch.Generator().manual_seed(n)
    rows = []
    for i in range(n):
        T = 3 + i % 5
        ids = tuple(torch.randint(0, VOCAB, (T,), generator=g).tolist())
        rows.append(TokenizedRow(first_id + 7 * i, ids, (0,) * (T - 2) + (1, 1)))  # sparse, non-contiguous ids
    return rows
