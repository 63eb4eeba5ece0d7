"""What the feature-server tests share: a tiny Llama's geometry, the spec they extract, small tokenized rows."""

import torch

from specdistill.core.contract import FeatureSpec, TokenizedRow

VOCAB, HIDDEN, LAYERS = 128, 32, 2
SPEC = FeatureSpec(layer_ids=(0, 1, LAYERS), hidden_dtype="float32")


def make_rows(n: int, first_id: int = 1000) -> list[TokenizedRow]:
    g = torch.Generator().manual_seed(n)
    rows = []
    for i in range(n):
        T = 3 + i % 5
        ids = tuple(torch.randint(0, VOCAB, (T,), generator=g).tolist())
        rows.append(TokenizedRow(first_id + 7 * i, ids, (0,) * (T - 2) + (1, 1)))  # sparse, non-contiguous ids
    return rows
