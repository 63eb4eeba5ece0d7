"""Packed training batches: several dataset rows laid end to end up to a token budget.

Packing keeps every row intact (document_ids tell rows apart, position_ids count each row's own positions), so a
drafter's attention mask can keep documents from seeing each other.

What a pack holds of each row is what its spec ships (core/contract.py, docs/scaling.md "What ships"):
- the token axis T: the row's context suffix [context_start, end) (the whole row unless a windowed-only run cuts it):
  input_ids_T, loss_mask_T, document_ids_T, position_ids_T (the row's own positions, context_start + j, so RoPE,
  windows and masks see the row as it is) and hidden_TLD, the context layers (`layer_ids`);
- the response axis R: the row's response suffix [response_start, end) of the response layers (`response_layer_ids`,
  the last layer where no drafter reads it as input) in response_RLD; `response_slot_T` maps a position of T to its
  row of response_RLD (-1 where none shipped). `layer_at(layer, positions)` reads either kind.

States shipped in fp8 (feature_server.hidden_dtype=float8_e4m3fn, core/contract.py) stay fp8 in a pack, their fp32
scales beside them (hidden_scale_TL, response_scale_RL: one per position and layer), until `to` multiplies them back
on the trainer's device; the readers (layers, layer_at) take a pack after that.

A pack may be padded to a fixed length (`pad_to`, the run's token budget on CUDA: specdistill/core/shapes.py): the
padding is one more document after the rows, with no loss, zero states and no row id, so no drafter trains on it
or attends to it from a row; `real_tokens` counts the rows' positions only. Its response rows are padded to a bucket
(core/shapes.py anchor_bucket) with zeros no position maps to.
"""

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace

import numpy as np
import torch

from specdistill.core.contract import SCALE_DTYPE, STATES_FIELDS, FeatureSample, FeatureSpec, dequantise
from specdistill.core.shapes import StaticShapes, anchor_bucket


def as_spec(layers: "FeatureSpec | Iterable[int]") -> FeatureSpec:
    """A FeatureSpec, or layer ids meaning whole rows of those layers (what callers before read|all passed)."""
    return layers if isinstance(layers, FeatureSpec) else FeatureSpec(tuple(layers))


@dataclass
class PackedBatch:
    input_ids_T: torch.Tensor  # int64
    loss_mask_T: torch.Tensor  # bool, response tokens
    hidden_TLD: torch.Tensor  # target states of the context layers, in `layer_ids` order
    document_ids_T: torch.Tensor  # int64, 0..num_docs-1 (a padded pack: num_docs = rows + 1, the padding last)
    position_ids_T: torch.Tensor  # int64, each row's own positions (context_start + j)
    layer_ids: tuple[int, ...]  # the context layers (hidden_TLD)
    row_ids: tuple[int, ...]
    real_tokens: int | None = None  # the rows' positions (None: all of them; less in a padded pack)
    static: StaticShapes | None = None  # the run's fixed shapes, read by the attention plans (core/shapes.py)
    response_RLD: torch.Tensor | None = None  # states of the response layers at the response positions
    response_layer_ids: tuple[int, ...] = ()
    response_slot_T: torch.Tensor | None = None  # int64: row of response_RLD of each position, -1 where none
    real_response: int | None = None  # response rows that are rows' (the rest padding)
    hidden_scale_TL: torch.Tensor | None = None  # fp8 states only: fp32 scale of each position and layer, until `to`
    response_scale_RL: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        """Tokens laid out, padding included (what tensors are sized by)."""
        return self.input_ids_T.shape[0]

    @property
    def num_real_tokens(self) -> int:
        """The rows' positions, padding excluded (what train_tokens and pack_fill count)."""
        return self.num_tokens if self.real_tokens is None else self.real_tokens

    @property
    def num_response_positions(self) -> int:
        """Response-layer positions of the rows (0 without response layers)."""
        if self.response_RLD is None:
            return 0
        return self.response_RLD.shape[0] if self.real_response is None else self.real_response

    def layers(self, ids: Iterable[int]) -> torch.Tensor:
        """[T, len(ids), D] states of context layers at every position (vLLM convention)."""
        self._check_unscaled()
        ids = list(ids)
        sparse = [i for i in ids if i in self.response_layer_ids]
        if sparse:
            raise KeyError(f"layer ids {sparse} ship only at response positions (feature_server.positions=read): "
                           "read them with layer_at(layer_id, positions)")
        missing = [i for i in ids if i not in self.layer_ids]
        if missing:
            raise KeyError(f"layer ids {missing} were not extracted (have {list(self.layer_ids)})")
        return self.hidden_TLD[:, [self.layer_ids.index(i) for i in ids]]

    def layer_at(self, layer_id: int, positions_P: torch.Tensor) -> torch.Tensor:
        """[P, D] states of one layer at pack positions: a context layer anywhere, a response layer where it
        shipped (an error, not a wrong row, elsewhere)."""
        self._check_unscaled()
        if layer_id in self.layer_ids:
            return self.hidden_TLD[positions_P, self.layer_ids.index(layer_id)]
        if layer_id not in self.response_layer_ids:
            raise KeyError(f"layer id {layer_id} was not extracted (have {list(self.layer_ids)} and, at response "
                           f"positions, {list(self.response_layer_ids)})")
        slots_P = self.response_slot_T[positions_P]
        if slots_P.device.type == "cpu":
            if slots_P.numel() and int(slots_P.min()) < 0:
                bad = positions_P[slots_P < 0][:5].tolist()
                raise IndexError(f"layer {layer_id} ships only from each row's first response token - 1; positions "
                                 f"{bad} of the pack are before that (a reader outside what its spec declared)")
        else:  # no host sync on the device: a device-side assert
            torch._assert_async((slots_P >= 0).all(), "a response layer was read where it did not ship")
        return self.response_RLD[slots_P, self.response_layer_ids.index(layer_id)]

    def _check_unscaled(self) -> None:
        if self.hidden_scale_TL is not None:
            raise ValueError("this pack's states are fp8 with their scales beside them: read them after "
                             ".to(device, dtype), which multiplies the scales back in")

    def to(self, device: torch.device, dtype: torch.dtype, non_blocking: bool = False) -> "PackedBatch":
        """On `device`, states in `dtype` (fp8 states times their scales: the scales are then dropped). A CUDA copy
        of a CPU pack should come from pinned memory in the pack's own dtype, cast on the device
        (trainer/device_copy.py): a blocking copy with a dtype change converts on the host first."""
        moved = {name: t.to(device, non_blocking=non_blocking) for name, t in self.tensors().items()}
        for states, scale in STATES_FIELDS:
            if states in moved:
                moved[states] = dequantise(moved[states], moved.pop(scale, None), dtype)
        return replace(self, **moved, hidden_scale_TL=None, response_scale_RL=None)

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {"input_ids_T": self.input_ids_T, "loss_mask_T": self.loss_mask_T, "hidden_TLD": self.hidden_TLD,
               "document_ids_T": self.document_ids_T, "position_ids_T": self.position_ids_T}
        if self.response_RLD is not None:
            out |= {"response_RLD": self.response_RLD, "response_slot_T": self.response_slot_T}
        for _, scale in STATES_FIELDS:
            if getattr(self, scale) is not None:
                out[scale] = getattr(self, scale)
        return out


def layout_ids(lengths: list[int], pad_to: int | None = None, device: torch.device | None = None,
               starts: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(document_ids_T, position_ids_T) of rows of `lengths` laid end to end, then (pad_to) a padding document.
    starts: each row's first position (its context_start; default 0), so positions keep the row's own values."""
    total = sum(lengths)
    if pad_to is not None and total > pad_to:
        raise ValueError(f"rows of {total} tokens do not fit a pack padded to {pad_to} (trainer.token_budget)")
    firsts = list(starts or [0] * len(lengths))
    if pad_to is not None and total < pad_to:
        lengths, firsts = [*lengths, pad_to - total], [*firsts, 0]
    counts = torch.tensor(lengths, dtype=torch.int64, device=device)
    document_ids_T = torch.repeat_interleave(torch.arange(len(lengths), device=device), counts)
    offsets_T = torch.repeat_interleave(counts.cumsum(0) - counts - torch.tensor(firsts, dtype=torch.int64,
                                                                                  device=device), counts)
    return document_ids_T, torch.arange(sum(lengths), device=device) - offsets_T


def response_slots(lengths: list[int], response_lengths: list[int], total: int,
                   device: torch.device | None = None) -> torch.Tensor:
    """[total] int64: for a pack of rows of `lengths` positions whose last `response_lengths` carry response-layer
    states (laid end to end in that order), the response row of each position; -1 elsewhere."""
    counts = torch.tensor(response_lengths, dtype=torch.int64, device=device)
    ends = torch.tensor(lengths, dtype=torch.int64, device=device).cumsum(0)
    first_R = torch.repeat_interleave(ends - counts - (counts.cumsum(0) - counts), counts)
    R = int(counts.sum())
    slot_T = torch.full((total,), -1, dtype=torch.int64, device=device)
    slot_T[first_R + torch.arange(R, device=device)] = torch.arange(R, device=device)
    return slot_T


def response_pad(rows: int, pad_to: int | None) -> int:
    """Response rows a pack is laid out over: its own, or on fixed shapes a bucket (few pinned buffer shapes)."""
    return rows if pad_to is None else min(anchor_bucket(rows), max(pad_to, rows))


def pack(samples: list[FeatureSample], spec: "FeatureSpec | Iterable[int]", pad_to: int | None = None) -> PackedBatch:
    """Samples laid end to end as `spec` ships them (module docstring; whole-row samples are cut to it); with pad_to,
    padded to that many tokens. Built where the samples are: the held-out walk moves a row to the GPU and pads it
    there, so its padding never crosses PCIe."""
    spec = as_spec(spec)
    samples = [_as_shipped(s, spec) for s in samples]
    lengths = [s.num_tokens - s.context_start for s in samples]
    real, pad = sum(lengths), (pad_to - sum(lengths) if pad_to else 0)
    device = samples[0].input_ids_T.device
    document_ids_T, position_ids_T = layout_ids(lengths, pad_to, device, [s.context_start for s in samples])
    zeros = lambda dtype: [torch.zeros(max(pad, 0), dtype=dtype, device=device)]  # noqa: E731
    states = _cat_states(samples, *STATES_FIELDS[0], real + max(pad, 0))
    response = {}
    if spec.response_layer_ids:
        R_r = [s.num_tokens - s.response_start for s in samples]
        response = {**_cat_states(samples, *STATES_FIELDS[1], response_pad(sum(R_r), pad_to)),
                    "response_layer_ids": spec.response_layer_ids,
                    "response_slot_T": response_slots(lengths, R_r, document_ids_T.shape[0], device),
                    "real_response": sum(R_r) if pad_to else None}
    return PackedBatch(
        input_ids_T=torch.cat([s.input_ids_T[s.context_start:] for s in samples] + zeros(torch.int64)),
        loss_mask_T=torch.cat([s.loss_mask_T[s.context_start:].bool() for s in samples] + zeros(torch.bool)),
        document_ids_T=document_ids_T,
        position_ids_T=position_ids_T,
        layer_ids=spec.context_layer_ids,
        row_ids=tuple(s.row_id for s in samples),
        real_tokens=real if pad_to else None,
        **states,
        **response,
    )


def _cat_states(samples: list[FeatureSample], field: str, scale_field: str, rows: int) -> dict[str, torch.Tensor]:
    """One states field of the samples laid end to end, and its fp8 scales if they have them, zero-padded to `rows`
    (the padding has zero states, whatever their scale)."""
    out = {}
    for name in (field, scale_field):
        parts = [getattr(s, name) for s in samples]
        if parts[0] is None:
            continue
        stacked = torch.cat(parts)
        if rows > stacked.shape[0]:
            stacked = torch.cat([stacked, stacked.new_zeros(rows - stacked.shape[0], *stacked.shape[1:])])
        out[name] = stacked
    return out


def _as_shipped(sample: FeatureSample, spec: FeatureSpec) -> FeatureSample:
    """A whole-row sample of spec.layer_ids cut to what spec ships; a sample already cut (from the feature server)
    as it is."""
    whole = (sample.response_RLD is None and sample.context_start == 0
             and tuple(sample.hidden_TLD.shape[:2]) == (sample.num_tokens, len(spec.layer_ids)))
    if whole and not spec.whole_rows:
        return sample.shipped(spec)
    sample.check(spec, sample.hidden_TLD.shape[-1], dtype=False)  # cut for another spec: an error, not a wrong pack
    return sample


def pack_stream(
    samples: Iterable[FeatureSample], token_budget: int, spec: "FeatureSpec | Iterable[int]"
) -> Iterator[PackedBatch]:
    """Greedy first-fit in arrival order, by the positions each row ships; a longer row gets a pack of its own."""
    spec = as_spec(spec)
    buffer: list[FeatureSample] = []
    used = 0
    for sample in samples:
        sample = _as_shipped(sample, spec)
        n = sample.num_tokens - sample.context_start
        if buffer and used + n > token_budget:
            yield pack(buffer, spec)
            buffer, used = [], 0
        buffer.append(sample)
        used += n
    if buffer:
        yield pack(buffer, spec)


def new_pack_buffers(tokens: int, layers: int, hidden: int, dtype: torch.dtype, response_tokens: int = 0,
                     response_layers: int = 0, scaled: bool = False,
                     pin_memory: bool = False) -> dict[str, torch.Tensor]:
    """Host buffers of one pack (PackAssembler's default; trainer/device_copy.py's pool holds pinned ones); scaled:
    with the fp8 states' scale buffers."""
    empty = lambda *shape, dtype: torch.empty(*shape, dtype=dtype, pin_memory=pin_memory)  # noqa: E731
    out = {"input_ids_T": empty(tokens, dtype=torch.int64), "loss_mask_T": empty(tokens, dtype=torch.bool),
           "hidden_TLD": empty(tokens, layers, hidden, dtype=dtype)}
    if response_layers:
        out["response_RLD"] = empty(response_tokens, response_layers, hidden, dtype=dtype)
    if scaled:
        for (states, scale), rows in zip(STATES_FIELDS, (tokens, response_tokens)):
            if states in out:
                out[scale] = empty(rows, out[states].shape[1], dtype=SCALE_DTYPE)
    return out


class PackAssembler:
    """Builds planned packs (data/packing.py) from samples that arrive in any order.

    `rows` is the stream in plan order and `pack_sizes` how many consecutive rows of it form each pack; `spec` what
    each row ships (its suffixes are computed from the rows' index, so a pack's layout is known before its rows
    arrive). A sample is copied into its pack's buffer the moment it arrives (so its shared-memory region is free
    again at once, whatever the other rows of its pack are doing): that is the one host copy a feature byte takes on
    the trainer's side. `add` returns the pack its row completed, else None. pad_to: every pack laid out over that
    many tokens (the padding filled in when the pack completes); buffers: where a pack's buffers come from
    (new_pack_buffers' signature; trainer/device_copy.py's pinned pool on CUDA).
    """

    def __init__(self, rows, pack_sizes: list[int], spec: "FeatureSpec | Iterable[int]", pad_to: int | None = None,
                 buffers: Callable[..., dict[str, torch.Tensor]] = new_pack_buffers):
        self.rows, self.spec, self.pad_to, self._buffers = rows, as_spec(spec), pad_to, buffers
        ends = np.cumsum(pack_sizes, dtype=np.int64)
        self._pack_of = np.repeat(np.arange(len(pack_sizes)), pack_sizes)  # position -> pack
        self._first = ends - np.asarray(pack_sizes, dtype=np.int64)  # pack -> its first position
        self._sizes = np.asarray(pack_sizes, dtype=np.int64)
        lengths = np.asarray(rows.num_tokens, dtype=np.int64)
        self._context_start, self._response_start = shipped_starts(rows, self.spec)
        self._shipped = lengths - self._context_start  # positions on the token axis
        self._response = lengths - self._response_start if self.spec.response_layer_ids else lengths * 0
        self._start = _offsets_in_pack(self._shipped, self._first, self._pack_of)  # position -> token offset in pack
        self._rstart = _offsets_in_pack(self._response, self._first, self._pack_of)
        total = lambda a: np.add.reduceat(a, self._first) if len(a) else np.zeros(0, np.int64)  # noqa: E731
        self._pack_tokens, self._pack_response = total(self._shipped), total(self._response)
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
        if sample.context_start != self._context_start[position]:
            raise ValueError(f"row {sample.row_id}: its states start at position {sample.context_start}, its pack "
                             f"planned them from {int(self._context_start[position])} (the workers' spec is not the "
                             "trainer's)")
        pack = self._open.get(p) or self._new_pack(p, sample)
        a, n = int(self._start[position]), int(self._shipped[position])
        pack["input_ids_T"][a:a + n] = sample.input_ids_T[sample.context_start:]
        pack["loss_mask_T"][a:a + n] = sample.loss_mask_T[sample.context_start:]
        r, m = int(self._rstart[position]), int(self._response[position])
        for name in _STATES_AND_SCALES:  # those the spec ships: the pack has buffers for them
            if name in pack:
                at, count = (r, m) if name in _RESPONSE_AXIS else (a, n)
                pack[name][at:at + count] = getattr(sample, name)
        pack["arrived"] += 1
        if pack["arrived"] < self._sizes[p]:
            return None
        del self._open[p]
        self.packs_done += 1
        return self._finish(p, pack)

    def _new_pack(self, p: int, sample: FeatureSample) -> dict:
        T = self.pad_to or int(self._pack_tokens[p])
        _, L, D = sample.hidden_TLD.shape
        shape = {"scaled": True} if self.spec.scaled else {}
        if self.spec.response_layer_ids:
            shape |= {"response_tokens": response_pad(int(self._pack_response[p]), self.pad_to),
                      "response_layers": len(self.spec.response_layer_ids)}
        pack = {**self._buffers(T, L, D, sample.hidden_TLD.dtype, **shape), "arrived": 0}
        self._open[p] = pack
        return pack

    def _finish(self, p: int, pack: dict) -> PackedBatch:
        positions = np.arange(self._first[p], self._first[p] + self._sizes[p])
        lengths = self._shipped[positions].tolist()
        real, real_response = int(self._pack_tokens[p]), int(self._pack_response[p])
        if self.pad_to is not None:  # the padding document: no loss, zero states (buffers are reused: set them)
            pack["input_ids_T"][real:] = 0
            pack["loss_mask_T"][real:] = False
            for name in _STATES_AND_SCALES:
                if name in pack:
                    pack[name][real_response if name in _RESPONSE_AXIS else real:] = 0
        document_ids_T, position_ids_T = layout_ids(lengths, self.pad_to,
                                                    starts=self._context_start[positions].tolist())
        response = {}
        if self.spec.response_layer_ids:
            response = {"response_layer_ids": self.spec.response_layer_ids,
                        "response_slot_T": response_slots(lengths, self._response[positions].tolist(),
                                                          document_ids_T.shape[0]),
                        "real_response": real_response if self.pad_to is not None else None}
        return PackedBatch(
            input_ids_T=pack["input_ids_T"], loss_mask_T=pack["loss_mask_T"],
            document_ids_T=document_ids_T, position_ids_T=position_ids_T, layer_ids=self.spec.context_layer_ids,
            row_ids=tuple(int(r) for r in np.asarray(self.rows.row_ids)[positions]),
            real_tokens=real if self.pad_to is not None else None,
            **{name: pack[name] for name in _STATES_AND_SCALES if name in pack}, **response,
        )


_STATES_AND_SCALES = tuple(name for pair in STATES_FIELDS for name in pair)
_RESPONSE_AXIS = STATES_FIELDS[1]  # response states and their scales: laid out on the response axis


def shipped_starts(rows, spec: FeatureSpec) -> tuple[np.ndarray, np.ndarray]:
    """([N] context_start, [N] response_start) of each row of an index (core/contract.py FeatureSpec.spans,
    vectorised): what the planner and the assembler lay out before any row is extracted."""
    lengths = np.asarray(rows.num_tokens, dtype=np.int64)
    if spec.whole_rows:
        return np.zeros_like(lengths), np.zeros_like(lengths)
    first = np.clip(np.asarray(rows.first_response, dtype=np.int64), 0, lengths)
    context = spec.context_starts(first, lengths)
    response = np.maximum(context, first - 1) if spec.response_layer_ids else context
    return context, response


def shipped_tokens(rows, spec: FeatureSpec) -> np.ndarray:
    """[N] positions each row puts on a pack's token axis (what the planner packs by)."""
    return np.asarray(rows.num_tokens, dtype=np.int64) - shipped_starts(rows, as_spec(spec))[0]


def _offsets_in_pack(lengths: np.ndarray, first: np.ndarray, pack_of: np.ndarray) -> np.ndarray:
    """Each position's offset inside its pack, for consecutive rows of `lengths` grouped as the plan says."""
    before = np.concatenate([[0], np.cumsum(lengths)])
    return before[:-1] - before[first[pack_of]] if len(lengths) else np.zeros(0, np.int64)
