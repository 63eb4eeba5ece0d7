"""The interface a target-model backend implements, and the registry the feature server builds them from.

A backend runs the target's prefill on tokenized rows and returns the requested hidden states. Registry values
are "module:Class" strings imported on demand, so the HF path never imports vLLM (and vice versa).
"""

import importlib
from abc import ABC, abstractmethod

import torch

from core.contract import FeatureSpec, TokenizedRow

# Listed explicitly; the key is what users type (feature_server.backend=hf).
BACKENDS: dict[str, str] = {
    "hf": "feature_server.hf_backend:HFBackend",
    "vllm": "feature_server.vllm_backend:VLLMBackend",
}


class FeatureBackend(ABC):
    """Built once per worker process. `extract` returns, per row, hidden_TLD = [T, len(spec.layer_ids), D]
    in spec.hidden_dtype on CPU, layers in spec.layer_ids order (vLLM layer-id convention, see core/contract.py)."""

    def __init__(self, target_dir: str, spec: FeatureSpec, device: str = "cpu", dtype: str | None = None):
        self.target_dir = target_dir
        self.spec = spec
        self.device = device
        self.dtype = dtype  # compute dtype of the target; None = the checkpoint's own

    @property
    @abstractmethod
    def num_hidden_layers(self) -> int: ...

    @property
    @abstractmethod
    def hidden_size(self) -> int: ...

    @abstractmethod
    def extract(self, rows: list[TokenizedRow]) -> list[torch.Tensor]: ...

    def close(self) -> None:
        """Release engine resources (processes, GPU memory); the default has none."""


def check_row(row: TokenizedRow, vocab_size: int) -> None:
    """Reject a row the target cannot prefill, naming the row and what was expected."""
    T = len(row.input_ids)
    if T == 0:
        raise ValueError(f"row {row.row_id}: no tokens")
    if len(row.loss_mask) != T:
        raise ValueError(f"row {row.row_id}: loss_mask has {len(row.loss_mask)} entries, input_ids has {T}")
    bad = [t for t in row.input_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"row {row.row_id}: token ids {bad[:5]} outside the target vocabulary [0, {vocab_size})")


def resolve_backend(name: str) -> type[FeatureBackend]:
    if name not in BACKENDS:
        raise ValueError(f"unknown feature backend {name!r}; valid names: {sorted(BACKENDS)}")
    module_path, _, cls_name = BACKENDS[name].partition(":")
    cls = getattr(importlib.import_module(module_path), cls_name)
    if not (isinstance(cls, type) and issubclass(cls, FeatureBackend)):
        raise TypeError(f"backend {name!r} -> {BACKENDS[name]} is not a FeatureBackend subclass")
    return cls


def build_backend(name: str, target_dir: str, spec: FeatureSpec, device: str = "cpu",
                  dtype: str | None = None) -> FeatureBackend:
    return resolve_backend(name)(target_dir, spec, device=device, dtype=dtype)
