"""Packed training batches: several dataset rows laid end to end up to a token budget.

Packing keeps every row intact (document_ids tell rows apart, position_ids restart per row), so a
drafter's attention mask can keep documents from seeing each other.
"""

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from core.contract import FeatureSample


@dataclass
class PackedBatch:
    input_ids_T: torch.Tensor  # int64
    loss_mask_T: torch.Tensor  # bool, response tokens
    hidden_TLD: torch.Tensor  # target states, layers in `layer_ids` order
    document_ids_T: torch.Tensor  # int64, 0..num_docs-1
    position_ids_T: torch.Tensor  # int64, restart at 0 per document
    layer_ids: tuple[int, ...]
    row_ids: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        return self.input_ids_T.shape[0]

    def layers(self, ids: Iterable[int]) -> torch.Tensor:
        """[T, len(ids), D] states of the requested layer ids (vLLM convention)."""
        ids = list(ids)
        missing = [i for i in ids if i not in self.layer_ids]
        if missing:
            raise KeyError(f"layer ids {missing} were not extracted (have {list(self.layer_ids)})")
        return self.hidden_TLD[:, [self.layer_ids.index(i) for i in ids]]

    def to(self, device: torch.device, dtype: torch.dtype) -> "PackedBatch":
        return PackedBatch(
            self.input_ids_T.to(device), self.loss_mask_T.to(device), self.hidden_TLD.to(device, dtype),
            self.document_ids_T.to(device), self.position_ids_T.to(device), self.layer_ids, self.row_ids,
        )


def pack(samples: list[FeatureSample], layer_ids: tuple[int, ...]) -> PackedBatch:
    lengths = [s.input_ids_T.shape[0] for s in samples]
    return PackedBatch(
        input_ids_T=torch.cat([s.input_ids_T for s in samples]),
        loss_mask_T=torch.cat([s.loss_mask_T.bool() for s in samples]),
        hidden_TLD=torch.cat([s.hidden_TLD for s in samples]),
        document_ids_T=torch.repeat_interleave(torch.arange(len(samples)), torch.tensor(lengths)),
        position_ids_T=torch.cat([torch.arange(n) for n in lengths]),
        layer_ids=layer_ids,
        row_ids=tuple(s.row_id for s in samples),
    )


def pack_stream(
    samples: Iterable[FeatureSample], token_budget: int, layer_ids: tuple[int, ...]
) -> Iterator[PackedBatch]:
    """Greedy first-fit in arrival order; a row longer than the budget gets a pack of its own."""
    buffer: list[FeatureSample] = []
    used = 0
    for sample in samples:
        n = sample.input_ids_T.shape[0]
        if buffer and used + n > token_budget:
            yield pack(buffer, layer_ids)
            buffer, used = [], 0
        buffer.append(sample)
        used += n
    if buffer:
        yield pack(buffer, layer_ids)
