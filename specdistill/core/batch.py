"""Packed training batches: several dataset rows laid end to end up to a token budget.

Packing keeps every row intact (document_ids tell rows apart, position_ids restart per row), so a
drafter's attention mask can keep documents from seeing each other.
"""

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from specdistill.core.contract import FeatureSample


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


class PackAssembler:
    """Builds planned packs (specdistill/data/packing.py) from samples that arrive in any order.

    `rows` is the stream in plan order and `pack_sizes` how many consecutive rows of it form each pack. A sample is
    copied into its pack's buffer the moment it arrives (so its shared-memory region is free again at once, whatever
    the other rows of its pack are doing); `add` returns the pack its row completed, else None.
    """

    def __init__(self, rows, pack_sizes: list[int], layer_ids: tuple[int, ...]):
        self.rows, self.layer_ids = rows, layer_ids
        ends = np.cumsum(pack_sizes, dtype=np.int64)
        self._pack_of = np.repeat(np.arange(len(pack_sizes)), pack_sizes)  # position -> pack
        self._first = ends - np.asarray(pack_sizes, dtype=np.int64)  # pack -> its first position
        self._sizes = np.asarray(pack_sizes, dtype=np.int64)
        lengths = np.asarray(rows.num_tokens, dtype=np.int64)
        before = np.concatenate([[0], np.cumsum(lengths)])  # tokens before each position in the stream
        self._start = before[:-1] - before[self._first[self._pack_of]]  # position -> token offset inside its pack
        self._pack_tokens = np.add.reduceat(lengths, self._first) if len(lengths) else np.zeros(0, np.int64)
        self._open: dict[int, dict] = {}  # pack -> buffers and rows arrived
        self.packs_done = 0

    @property
    def open_packs(self) -> int:
        return len(self._open)

    def add(self, sample: FeatureSample) -> "PackedBatch | None":
        position = self.rows.position_of(sample.row_id)
        p = int(self._pack_of[position])
        pack = self._open.get(p) or self._new_pack(p, sample)
        a, n = int(self._start[position]), sample.input_ids_T.shape[0]
        pack["input_ids_T"][a:a + n] = sample.input_ids_T
        pack["loss_mask_T"][a:a + n] = sample.loss_mask_T
        pack["hidden_TLD"][a:a + n] = sample.hidden_TLD
        pack["arrived"] += 1
        if pack["arrived"] < self._sizes[p]:
            return None
        del self._open[p]
        self.packs_done += 1
        return self._finish(p, pack)

    def _new_pack(self, p: int, sample: FeatureSample) -> dict:
        T = int(self._pack_tokens[p])
        _, L, D = sample.hidden_TLD.shape
        pack = {"input_ids_T": torch.empty(T, dtype=torch.int64), "loss_mask_T": torch.empty(T, dtype=torch.bool),
                "hidden_TLD": torch.empty(T, L, D, dtype=sample.hidden_TLD.dtype), "arrived": 0}
        self._open[p] = pack
        return pack

    def _finish(self, p: int, pack: dict) -> PackedBatch:
        positions = np.arange(self._first[p], self._first[p] + self._sizes[p])
        lengths = torch.from_numpy(np.asarray(self.rows.num_tokens)[positions].astype(np.int64))
        return PackedBatch(
            input_ids_T=pack["input_ids_T"], loss_mask_T=pack["loss_mask_T"], hidden_TLD=pack["hidden_TLD"],
            document_ids_T=torch.repeat_interleave(torch.arange(len(lengths)), lengths),
            position_ids_T=torch.cat([torch.arange(int(n)) for n in lengths]),
            layer_ids=self.layer_ids,
            row_ids=tuple(int(r) for r in np.asarray(self.rows.row_ids)[positions]),
        )
