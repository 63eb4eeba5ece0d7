"""What a drafter asks of the target, and what crosses the process boundary per sample.

A drafter declares a `FeatureSpec`; the feature server reads it and never imports drafter code.
Layer ids follow vLLM's convention: id k is the residual stream after k decoder layers, so 0 is the
embedding output and `num_hidden_layers` is the last layer's output *before* the final norm.
"""

from dataclasses import dataclass

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# The dtype hidden states cross the process boundary in unless a run sets feature_server.hidden_dtype: half
# of fp32's bytes through shared memory.
DEFAULT_HIDDEN_DTYPE = "bfloat16"


@dataclass(frozen=True)
class FeatureSpec:
    layer_ids: tuple[int, ...]  # ascending, deduplicated (vLLM sorts them too)
    hidden_dtype: str = DEFAULT_HIDDEN_DTYPE

    def __post_init__(self):
        if list(self.layer_ids) != sorted(set(self.layer_ids)):
            raise ValueError(f"layer_ids must be ascending and unique, got {list(self.layer_ids)}")
        if self.hidden_dtype not in DTYPES:
            raise ValueError(f"hidden_dtype {self.hidden_dtype!r} not in {sorted(DTYPES)}")

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


@dataclass
class FeatureSample:
    """One dataset row after the target's prefill. Shapes: T tokens, L requested layers, D hidden."""

    row_id: int
    input_ids_T: torch.Tensor  # int64
    loss_mask_T: torch.Tensor  # bool, True on response tokens
    hidden_TLD: torch.Tensor  # spec.hidden_dtype, layers in spec.layer_ids order

    def check(self, spec: FeatureSpec, hidden_size: int) -> None:
        """Validate a sample that crossed a process boundary (shapes, dtypes, ids)."""
        T = self.input_ids_T.shape[0]
        want = (T, len(spec.layer_ids), hidden_size)
        if tuple(self.hidden_TLD.shape) != want:
            raise ValueError(f"row {self.row_id}: hidden states shape {tuple(self.hidden_TLD.shape)}, expected {want}")
        if self.hidden_TLD.dtype != spec.torch_dtype:
            raise ValueError(f"row {self.row_id}: hidden dtype {self.hidden_TLD.dtype}, expected {spec.torch_dtype}")
        if self.loss_mask_T.shape != (T,) or self.input_ids_T.dtype != torch.int64:
            raise ValueError(f"row {self.row_id}: input_ids/loss_mask malformed ({self.input_ids_T.dtype}, {tuple(self.loss_mask_T.shape)} vs T={T})")


@dataclass(frozen=True)
class TokenizedRow:
    """One dataset row, tokenized: loss_mask is 1 exactly on the response tokens."""

    row_id: int
    input_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)
