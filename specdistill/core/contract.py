"""What a drafter asks of the target, and what crosses the process boundary per sample.

A drafter declares a `FeatureSpec`; the feature server reads it and never imports drafter code.
Layer ids follow vLLM's convention: id k is the residual stream after k decoder layers, so 0 is the
embedding output and `num_hidden_layers` is the last layer's output *before* the final norm.

Which positions of a row ship (docs/scaling.md, "What ships"): a spec says it as data, two suffixes of the row.
- Context layers (every layer but the response layers) ship from `context_start` to the row's end: the whole row,
  or, with `context_window` W, from the row's first response token minus W (a windowed drafter's first anchor is
  the first response token, and its keys reach back W tokens: nothing before that is ever read).
- Response layers (the last layer, where no drafter reads it as an input) ship from `response_start` (the first
  response token - 1, whose state gives the target's distribution of that token) to the row's end: the only
  positions a loss, the held-out walk or the baselines read them at.
Token ids and the loss mask ship for the whole row (the n-gram baseline searches the whole prompt). Both suffixes
are functions of the row's first response token, so workers and the trainer compute them alike (`RowSpans`).

In which bytes (`hidden_dtype`, feature_server.hidden_dtype): bfloat16 by default; `float8_e4m3fn` ships each states
field as e4m3 values with one fp32 scale per position and layer beside it (`hidden_scale_TL`, `response_scale_RL`):
quantised where the states are made (the worker's or the engine's device, `encode_states`), carried as they are
through the rings and the pack buffers, multiplied back on the trainer's device (core/batch.py PackedBatch.to), so a
step sees fp32 as before. Per value the error is at most max(2^-4 |x|, 2^-10 s), s = the [position, layer]'s
amax / 448 (`quantise_fp8`); docs/scaling.md, "FP8 states".
"""

from collections.abc import Iterable
from dataclasses import dataclass, field, replace

import numpy as np
import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float8_e4m3fn": torch.float8_e4m3fn}
# The dtype hidden states cross the process boundary in unless a run sets feature_server.hidden_dtype: half
# of fp32's bytes through shared memory.
DEFAULT_HIDDEN_DTYPE = "bfloat16"
FP8 = torch.float8_e4m3fn  # the one scaled dtype: values in it travel with a scale per position and layer
FP8_MAX = 448.0  # e4m3's largest finite value: a [position, layer]'s amax maps to it
SCALE_DTYPE = torch.float32
# Each states field of a sample and the scale field beside it when the states are fp8 (sample_fields order).
STATES_FIELDS = (("hidden_TLD", "hidden_scale_TL"), ("response_RLD", "response_scale_RL"))


# feature_server.positions: "read" ships what the run's drafters read (the spec's suffixes); "all" every position of
# every layer (the comparison: equal losses and gradients, tests/test_positions_read.py).
POSITIONS = ("read", "all")


@dataclass(frozen=True)
class RowSpans:
    """Where one row's states start: context layers at [context_start, T), response layers at [response_start, T)."""

    context_start: int
    response_start: int


@dataclass(frozen=True)
class FeatureSpec:
    layer_ids: tuple[int, ...]  # every layer shipped: ascending, deduplicated (vLLM sorts them too)
    hidden_dtype: str = DEFAULT_HIDDEN_DTYPE
    # None: context layers ship every position; W: from the first response token - W (module docstring).
    context_window: int | None = None
    # Layers shipped only from the first response token - 1 (the target's distribution); a subset of layer_ids.
    response_layer_ids: tuple[int, ...] = field(default=())

    def __post_init__(self):
        if list(self.layer_ids) != sorted(set(self.layer_ids)):
            raise ValueError(f"layer_ids must be ascending and unique, got {list(self.layer_ids)}")
        if self.hidden_dtype not in DTYPES:
            raise ValueError(f"hidden_dtype {self.hidden_dtype!r} not in {sorted(DTYPES)}")
        if list(self.response_layer_ids) != sorted(set(self.response_layer_ids)) or \
                not set(self.response_layer_ids) <= set(self.layer_ids):
            raise ValueError(f"response_layer_ids {list(self.response_layer_ids)} must be ascending, unique and among "
                             f"layer_ids {list(self.layer_ids)}")
        if self.context_window is not None and self.context_window < 1:
            raise ValueError(f"context_window={self.context_window}: need >= 1 (or None for whole rows)")

    @property
    def context_layer_ids(self) -> tuple[int, ...]:
        """The layers shipped over the context suffix (hidden_TLD), in order."""
        return tuple(i for i in self.layer_ids if i not in self.response_layer_ids)

    @property
    def whole_rows(self) -> bool:
        """Every layer ships every position (what feature_server.positions=all gives)."""
        return self.context_window is None and not self.response_layer_ids

    def positions(self) -> dict:
        """What ships, as metrics.json records it."""
        return {"context_window": self.context_window, "context_layer_ids": list(self.context_layer_ids),
                "response_layer_ids": list(self.response_layer_ids)}

    def describe(self) -> str:
        """What ships, in a sentence (logged when a run starts)."""
        context = (f"layers {list(self.context_layer_ids)} at whole rows (a drafter of the run attends to whole "
                   "documents, or feature_server.positions=all)" if self.context_window is None else
                   f"layers {list(self.context_layer_ids)} from {self.context_window} tokens before each row's first "
                   "response token")
        response = (f"; layers {list(self.response_layer_ids)} from each row's first response token - 1 (the "
                    "target's distribution)" if self.response_layer_ids else "")
        return context + response + f"; {self.hidden_dtype}"

    def spans(self, first_response: int, num_tokens: int) -> RowSpans:
        """The row's two suffixes (module docstring); first_response = num_tokens for a row with no response."""
        first = min(max(first_response, 0), num_tokens)
        context = 0 if self.context_window is None else max(0, first - self.context_window)
        response = max(context, min(first, num_tokens) - 1) if self.response_layer_ids else context
        return RowSpans(context, response)

    def context_starts(self, first_response_N: np.ndarray, num_tokens_N: np.ndarray) -> np.ndarray:
        """[N] context_start of each row (`spans`, vectorised over an index: the pack planner's lengths)."""
        first = np.clip(np.asarray(first_response_N, dtype=np.int64), 0, np.asarray(num_tokens_N, dtype=np.int64))
        return np.zeros_like(first) if self.context_window is None else np.maximum(first - self.context_window, 0)

    def row_spans(self, loss_mask_T) -> RowSpans:
        mask = torch.as_tensor(loss_mask_T)
        hits = torch.nonzero(mask).flatten()
        return self.spans(int(hits[0]) if hits.numel() else mask.shape[0], mask.shape[0])

    def check_against(self, num_hidden_layers: int) -> None:
        bad = [i for i in self.layer_ids if not 0 <= i <= num_hidden_layers]
        if bad:
            raise ValueError(
                f"layer ids {bad} out of range: the target has {num_hidden_layers} decoder layers, "
                f"so valid ids are 0..{num_hidden_layers} (0 = embeddings, {num_hidden_layers} = last "
                "layer before the final norm)"
            )

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.hidden_dtype]

    @property
    def scaled(self) -> bool:
        """States ship as fp8 values with a scale per position and layer (module docstring)."""
        return self.torch_dtype == FP8

    @property
    def values_dtype(self) -> torch.dtype:
        """The dtype a reader gets the shipped states in (extract, shipped_values): hidden_dtype, fp32 for fp8."""
        return torch.float32 if self.scaled else self.torch_dtype

    def bytes_per_state(self, hidden_size: int) -> int:
        """Bytes one layer's state at one position takes through the rings: its values, and its scale if fp8."""
        return hidden_size * self.torch_dtype.itemsize + (SCALE_DTYPE.itemsize if self.scaled else 0)

    @classmethod
    def union(cls, specs: Iterable["FeatureSpec"], hidden_dtype: str = DEFAULT_HIDDEN_DTYPE,
              positions: str = "read") -> "FeatureSpec":
        """What one stream must carry for several readers (a run's drafters): every layer any of them reads; the
        widest context (whole rows if any reader needs them); a layer ships as a response layer only where no
        reader takes it as context. positions="all": whole rows of every layer."""
        if positions not in POSITIONS:
            raise ValueError(f"feature_server.positions={positions!r}; valid: {', '.join(POSITIONS)}")
        specs = list(specs)
        layer_ids = tuple(sorted(set().union(*(s.layer_ids for s in specs))))
        if positions == "all":
            return cls(layer_ids, hidden_dtype)
        windows = [s.context_window for s in specs]
        window = None if None in windows else max(windows)
        context = set().union(*(s.context_layer_ids for s in specs))
        response = tuple(sorted(set().union(*(s.response_layer_ids for s in specs)) - context))
        return cls(layer_ids, hidden_dtype, window, response)


@dataclass
class FeatureSample:
    """One dataset row after the target's prefill. Shapes: T tokens (the whole row), C = T - context_start context
    positions, R = T - response_start response positions, L layers, D hidden (module docstring)."""

    row_id: int
    input_ids_T: torch.Tensor  # int64, the whole row
    loss_mask_T: torch.Tensor  # bool, True on response tokens, the whole row
    hidden_TLD: torch.Tensor  # [C, L, D] spec.hidden_dtype, spec.context_layer_ids in order
    response_RLD: torch.Tensor | None = None  # [R, L, D] spec.response_layer_ids in order (None: there are none)
    context_start: int = 0
    response_start: int = 0
    hidden_scale_TL: torch.Tensor | None = None  # [C, L] fp32, with fp8 states only (module docstring)
    response_scale_RL: torch.Tensor | None = None  # [R, L] fp32, with fp8 response states only

    @property
    def num_tokens(self) -> int:
        return self.input_ids_T.shape[0]

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor field that is set, by name."""
        names = ("input_ids_T", "loss_mask_T") + tuple(name for pair in STATES_FIELDS for name in pair)
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}

    def to(self, device: torch.device) -> "FeatureSample":
        """This sample on `device`, as it is (fp8 states stay fp8: core/batch.py PackedBatch.to casts)."""
        return replace(self, **{name: t.to(device) for name, t in self.tensors().items()})

    def dequantised(self) -> "FeatureSample":
        """This sample with fp8 states multiplied back to fp32 (their scales dropped); other states as they are."""
        if self.hidden_scale_TL is None:
            return self
        return replace(self, hidden_TLD=dequantise(self.hidden_TLD, self.hidden_scale_TL, torch.float32),
                       response_RLD=None if self.response_RLD is None else
                       dequantise(self.response_RLD, self.response_scale_RL, torch.float32),
                       hidden_scale_TL=None, response_scale_RL=None)

    def clone(self) -> "FeatureSample":
        """A copy that holds no view of the tensors it was made from (a ring region is free once they are gone)."""
        return replace(self, **{name: t.clone() for name, t in self.tensors().items()})

    def check(self, spec: FeatureSpec, hidden_size: int, dtype: bool = True) -> None:
        """Validate a sample that crossed a process boundary (shapes, dtypes and fp8 scales unless dtype=False, ids,
        the positions shipped)."""
        T = self.input_ids_T.shape[0]
        if self.loss_mask_T.shape != (T,) or self.input_ids_T.dtype != torch.int64:
            raise ValueError(f"row {self.row_id}: input_ids/loss_mask malformed ({self.input_ids_T.dtype}, {tuple(self.loss_mask_T.shape)} vs T={T})")
        spans = spec.row_spans(self.loss_mask_T)
        if (self.context_start, self.response_start) != (spans.context_start, spans.response_start):
            raise ValueError(f"row {self.row_id}: states start at positions ({self.context_start}, "
                             f"{self.response_start}), the spec ships them from ({spans.context_start}, "
                             f"{spans.response_start})")
        fields = [("hidden states", self.hidden_TLD, self.hidden_scale_TL, T - spans.context_start,
                   spec.context_layer_ids)]
        if spec.response_layer_ids:
            fields.append(("response states", self.response_RLD, self.response_scale_RL, T - spans.response_start,
                           spec.response_layer_ids))
        elif self.response_RLD is not None:
            raise ValueError(f"row {self.row_id}: carries response states, the spec ships no response layers")
        for what, tensor, scale, positions, layers in fields:
            where = f"layers {list(layers)} (positions {T - positions}..{T - 1} of its {T} tokens)"
            _check_tensor(f"row {self.row_id}: {what}", tensor, (positions, len(layers), hidden_size),
                          spec.torch_dtype if dtype else None, where)
            if spec.scaled and dtype:  # dtype=False: states already cast (dequantised), their scales gone
                _check_tensor(f"row {self.row_id}: scales of its {what}", scale, (positions, len(layers)),
                              SCALE_DTYPE, where)
            elif scale is not None and not spec.scaled:
                raise ValueError(f"row {self.row_id}: carries scales of its {what}, the spec ships "
                                 f"{spec.hidden_dtype}, which has none")

    def shipped(self, spec: FeatureSpec) -> "FeatureSample":
        """This sample as `spec` ships it, cut from a whole-row sample of spec.layer_ids (tools, tests, the
        transformers backend): context layers from context_start, response layers from response_start."""
        if self.context_start or self.response_RLD is not None:
            raise ValueError(f"row {self.row_id}: already cut to the positions a spec ships")
        spans = spec.row_spans(self.loss_mask_T)
        scales = (None, None) if self.hidden_scale_TL is None else cut_states(self.hidden_scale_TL, spec, spans)
        return FeatureSample(self.row_id, self.input_ids_T, self.loss_mask_T,
                             *cut_states(self.hidden_TLD, spec, spans), spans.context_start, spans.response_start,
                             *scales)


def _check_tensor(what: str, tensor: torch.Tensor | None, shape: tuple, dtype: torch.dtype | None,
                  where: str) -> None:
    if tensor is None or tuple(tensor.shape) != shape:
        raise ValueError(f"{what} of {where} have shape {None if tensor is None else tuple(tensor.shape)}, expected "
                         f"{shape}")
    if dtype is not None and tensor.dtype != dtype:
        raise ValueError(f"{what} of {where} are {tensor.dtype}, expected {dtype}")


def sample_fields(spec: FeatureSpec) -> tuple[str, ...]:
    """The tensors of one row's sample as it crosses to the trainer (feature_server/backends.py sample_layout)."""
    pairs = STATES_FIELDS if spec.response_layer_ids else STATES_FIELDS[:1]
    return ("input_ids_T", "loss_mask_T") + tuple(name for states, scale in pairs
                                                  for name in ((states, scale) if spec.scaled else (states,)))


def quantise_fp8(states_NLD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(values [N, L, D] e4m3, scales [N, L] fp32) with values * scales ~ states, on the states' device.

    Each [position, layer] is scaled so its amax lands on 448, e4m3's largest value, and rounded to nearest: a value x
    comes back within 2^-4 |x| (3 mantissa bits) where x / s is normal (>= 2^-6), and within 2^-10 s (half the
    subnormal step 2^-9) below, s = amax / 448. A row of zeros gets scale 1; a non-finite state makes its
    [position, layer] NaN, which the trainer's finiteness checks then see."""
    x_NLD = states_NLD.float()
    scale_NL = x_NLD.abs().amax(-1) / FP8_MAX
    scale_NL = torch.where(scale_NL == 0, torch.ones_like(scale_NL), scale_NL)
    values_NLD = (x_NLD / scale_NL[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return values_NLD, scale_NL


def dequantise(states_NLD: torch.Tensor, scale_NL: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """States in `dtype`: as they are (no scale), or fp8 values times their scales (computed in fp32)."""
    if scale_NL is None:
        return states_NLD.to(dtype)
    return (states_NLD.float() * scale_NL.float()[..., None]).to(dtype)


def encode_states(field: str, states_NLD: torch.Tensor, hidden_dtype: str) -> dict[str, torch.Tensor]:
    """One states field as a sample carries it, on the states' device: {field: states in hidden_dtype}, or for fp8
    also its scale field (STATES_FIELDS)."""
    dtype = DTYPES[hidden_dtype]
    if dtype != FP8:
        return {field: states_NLD.to(dtype)}
    values_NLD, scale_NL = quantise_fp8(states_NLD)
    return {field: values_NLD, dict(STATES_FIELDS)[field]: scale_NL}


def shipped_values(states_NLD: torch.Tensor, spec: FeatureSpec) -> torch.Tensor:
    """States as the trainer's step sees them once they crossed (tools, tests): cast to spec.hidden_dtype, or for
    fp8 quantised and multiplied back to fp32."""
    encoded = encode_states("hidden_TLD", states_NLD, spec.hidden_dtype)
    return dequantise(encoded["hidden_TLD"], encoded.get("hidden_scale_TL"), spec.values_dtype)


def cut_states(states_TLD: torch.Tensor, spec: FeatureSpec, spans: RowSpans) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(context states [C, Lc, D], response states [R, Lr, D] or None) of a whole row's states of spec.layer_ids,
    on the states' own device (a GPU backend cuts before the copy to the host). Views where the columns allow. Their
    fp8 scales [T, L] are cut alike."""
    cols = lambda ids: [spec.layer_ids.index(i) for i in ids]  # noqa: E731
    context = spec.context_layer_ids
    hidden = states_TLD[spans.context_start:]
    if len(context) != len(spec.layer_ids):
        hidden = hidden[:, cols(context)]
    response = states_TLD[spans.response_start:, cols(spec.response_layer_ids)] if spec.response_layer_ids else None
    return hidden, response


@dataclass(frozen=True)
class TokenizedRow:
    """One dataset row, tokenized: loss_mask is 1 exactly on the response tokens."""

    row_id: int
    input_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)
