"""Packed training batches: several dataset rows laid end to end up to a token budget.

Packing keeps every row intact (document_ids tell rows apart, position_ids restart per row), so a
drafter's attention mask can keep documents from seeing each other.

A pack may be padded to a fixed length (`pad_to`, the run's token budget on CUDA: specdistill/core/shapes.py): the
padding is one more document after the rows, with no loss, zero states and no row id, so no drafter trains on it
or attends to it from a row; `real_tokens` counts the rows' tokens only.
"""

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace

import numpy as np
import torch

from specdistill.core.contract import FeatureSample
from specdistill.core.shapes import StaticShapes


@dataclass
class PackedBatch:
    input_ids_T: torch.Tensor  # int64
    loss_mask_T: torch.Tensor  # bool, response tokens
    hidden_TLD: torch.Tensor  # target states, layers in `layer_ids` order
    document_ids_T: torch.Tensor  # int64, 0..num_docs-1 (a padded pack: num_docs = rows + 1, the padding last)
    position_ids_T: torch.Tensor  # int64, restart at 0 per document
    layer_ids: tuple[int, ...]
    row_ids: tuple[int, ...]
    real_tokens: int | None = None  # the rows' tokens (None: all of them; less in a padded pack)
    static: StaticShapes | None = None  # the run's fixed shapes, read by the attention plans (core/shapes.py)

    @property
    def num_tokens(self) -> int:
        """Tokens laid out, padding included (what tensors are sized by)."""
        return self.input_ids_T.shape[0]

    @property
    def num_real_tokens(self) -> int:
        """The rows' tokens, padding excluded (what train_tokens and pack_fill count)."""
        return self.num_tokens if self.real_tokens is None else self.real_tokens

    def layers(self, ids: Iterable[int]) -> torch.Tensor:
        """[T, len(ids), D] states of the requested layer ids (vLLM convention)."""
        ids = list(ids)
        missing = [i for i in ids if i not in self.layer_ids]
        if missing:
            raise KeyError(f"layer ids {missing} were not extracted (have {list(self.layer_ids)})")
        return self.hidden_TLD[:, [self.layer_ids.index(i) for i in ids]]

    def to(self, device: torch.device, dtype: torch.dtype, non_blocking: bool = False) -> "PackedBatch":
        """On `device`, states in `dtype`. A CUDA copy of a CPU pack should come from pinned memory in the pack's
        own dtype, cast on the device (trainer/device_copy.py): a blocking copy with a dtype change converts on the
        host first."""
        move = lambda t: t.to(device, non_blocking=non_blocking)  # noqa: E731
        return replace(self, input_ids_T=move(self.input_ids_T), loss_mask_T=move(self.loss_mask_T),
                       hidden_TLD=move(self.hidden_TLD).to(dtype), document_ids_T=move(self.document_ids_T),
                       position_ids_T=move(self.position_ids_T))

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"input_ids_T": self.input_ids_T, "loss_mask_T": self.loss_mask_T, "hidden_TLD": self.hidden_TLD,
                "document_ids_T": self.document_ids_T, "position_ids_T": self.position_ids_T}


def layout_ids(lengths: list[int], pad_to: int | None = None,
               device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(document_ids_T, position_ids_T) of rows of `lengths` laid end to end, then (pad_to) a padding document."""
    total = sum(lengths)
    if pad_to is not None and total > pad_to:
        raise ValueError(f"rows of {total} tokens do not fit a pack padded to {pad_to} (trainer.token_budget)")
    if pad_to is not None and total < pad_to:
        lengths = [*lengths, pad_to - total]
    counts = torch.tensor(lengths, dtype=torch.int64, device=device)
    document_ids_T = torch.repeat_interleave(torch.arange(len(lengths), device=device), counts)
    starts_T = torch.repeat_interleave(counts.cumsum(0) - counts, counts)
    return document_ids_T, torch.arange(sum(lengths), device=device) - starts_T


def pack(samples: list[FeatureSample], layer_ids: tuple[int, ...], pad_to: int | None = None) -> PackedBatch:
    """Samples laid end to end; with pad_to, padded to that many tokens (module docstring). Built where the samples
    are: the held-out walk moves a row to the GPU and pads it there, so its padding never crosses PCIe."""
    lengths = [s.input_ids_T.shape[0] for s in samples]
    real, pad = sum(lengths), (pad_to - sum(lengths) if pad_to else 0)
    device = samples[0].input_ids_T.device
    hidden = [s.hidden_TLD for s in samples]
    if pad > 0:
        hidden.append(samples[0].hidden_TLD.new_zeros(pad, *samples[0].hidden_TLD.shape[1:]))
    document_ids_T, position_ids_T = layout_ids(lengths, pad_to, device)
    zeros = lambda dtype: [torch.zeros(max(pad, 0), dtype=dtype, device=device)]  # noqa: E731
    return PackedBatch(
        input_ids_T=torch.cat([s.input_ids_T for s in samples] + zeros(torch.int64)),
        loss_mask_T=torch.cat([s.loss_mask_T.bool() for s in samples] + zeros(torch.bool)),
        hidden_TLD=torch.cat(hidden),
        document_ids_T=document_ids_T,
        position_ids_T=position_ids_T,
        layer_ids=layer_ids,
        row_ids=tuple(s.row_id for s in samples),
        real_tokens=real if pad_to else None,
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


def new_pack_buffers(tokens: int, layers: int, hidden: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Host buffers of one pack (PackAssembler's default; trainer/device_copy.py hands out pinned ones)."""
    return {"input_ids_T": torch.empty(tokens, dtype=torch.int64), "loss_mask_T": torch.empty(tokens, dtype=torch.bool),
            "hidden_TLD": torch.empty(tokens, layers, hidden, dtype=dtype)}


class PackAssembler:
    """Builds planned packs (data/packing.py) from samples that arrive in any order.

    `rows` is the stream in plan order and `pack_sizes` how many consecutive rows of it form each pack. A sample is
    copied into its pack's buffer the moment it arrives (so its shared-memory region is free again at once, whatever
    the other rows of its pack are doing): that is the one host copy a feature byte takes on the trainer's side.
    `add` returns the pack its row completed, else None. pad_to: every pack laid out over that many tokens (the
    padding filled in when the pack completes); buffers: where a pack's buffers come from (new_pack_buffers'
    signature; trainer/device_copy.py's pinned pool on CUDA).
    """

    def __init__(self, rows, pack_sizes: list[int], layer_ids: tuple[int, ...], pad_to: int | None = None,
                 buffers: Callable[..., dict[str, torch.Tensor]] = new_pack_buffers):
        self.rows, self.layer_ids, self.pad_to, self._buffers = rows, layer_ids, pad_to, buffers
        ends = np.cumsum(pack_sizes, dtype=np.int64)
        self._pack_of = np.repeat(np.arange(len(pack_sizes)), pack_sizes)  # position -> pack
        self._first = ends - np.asarray(pack_sizes, dtype=np.int64)  # pack -> its first position
        self._sizes = np.asarray(pack_sizes, dtype=np.int64)
        lengths = np.asarray(rows.num_tokens, dtype=np.int64)
        before = np.concatenate([[0], np.cumsum(lengths)])  # tokens before each position in the stream
        self._start = before[:-1] - before[self._first[self._pack_of]]  # position -> token offset inside its pack
        self._pack_tokens = np.add.reduceat(lengths, self._first) if len(lengths) else np.zeros(0, np.int64)
        if pad_to is not None and len(self._pack_tokens) and int(self._pack_tokens.max()) > pad_to:
            raise ValueError(f"a planned pack holds {int(self._pack_tokens.max())} tokens, more than it is padded to "
                             f"({pad_to}, trainer.token_budget)")
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
        T = self.pad_to or int(self._pack_tokens[p])
        _, L, D = sample.hidden_TLD.shape
        pack = {**self._buffers(T, L, D, sample.hidden_TLD.dtype), "arrived": 0}
        self._open[p] = pack
        return pack

    def _finish(self, p: int, pack: dict) -> PackedBatch:
        positions = np.arange(self._first[p], self._first[p] + self._sizes[p])
        lengths = np.asarray(self.rows.num_tokens)[positions].astype(np.int64).tolist()
        real = int(self._pack_tokens[p])
        if self.pad_to is not None:  # the padding document: no loss, zero states (buffers are reused: set them)
            pack["input_ids_T"][real:] = 0
            pack["loss_mask_T"][real:] = False
            pack["hidden_TLD"][real:] = 0
        document_ids_T, position_ids_T = layout_ids(lengths, self.pad_to)
        return PackedBatch(
            input_ids_T=pack["input_ids_T"], loss_mask_T=pack["loss_mask_T"], hidden_TLD=pack["hidden_TLD"],
            document_ids_T=document_ids_T, position_ids_T=position_ids_T, layer_ids=self.layer_ids,
            row_ids=tuple(int(r) for r in np.asarray(self.rows.row_ids)[positions]),
            real_tokens=real if self.pad_to is not None else None,
        )
