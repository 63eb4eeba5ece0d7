"""A random packed batch for the drafter tests: documents of the given lengths, each a prompt then a response."""

import torch

from specdistill.core.batch import PackedBatch
from specdistill.core.target import TargetInfo


def make_batch(info: TargetInfo, layer_ids, lengths=(20, 14), prompt=(8, 6), seed=0) -> PackedBatch:
    g = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    return PackedBatch(
        input_ids_T=torch.randint(0, info.vocab_size, (T,), generator=g),
        loss_mask_T=torch.cat([torch.arange(n) >= p for n, p in zip(lengths, prompt)]),
        hidden_TLD=torch.randn(T, len(layer_ids), info.hidden_size, generator=g),
        document_ids_T=torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)),
        position_ids_T=torch.cat([torch.arange(n) for n in lengths]),
        layer_ids=tuple(layer_ids),
        row_ids=tuple(range(len(lengths))),
    )
