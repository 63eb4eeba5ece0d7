"""The interface a target-model backend implements, and the registry the feature server builds them from.

A backend runs the target's prefill on tokenized rows and returns the requested hidden states (`extract`), or
publishes each row's sample through a feature worker's ShmProducer (`publish`; by default extract, then one copy
into the ring). Registry values are "module:Class" strings imported on demand, so the HF path never imports vLLM
(and vice versa).
"""

import importlib
import time
from abc import ABC, abstractmethod

import torch

from specdistill.core.contract import SCALE_DTYPE, STATES_FIELDS, FeatureSpec, TokenizedRow, cut_states, encode_states
from specdistill.feature_server.shm_transport import ShmProducer

# Listed explicitly; the key is what users type (feature_server.backend=hf).
BACKENDS: dict[str, str] = {
    "hf": "specdistill.feature_server.hf_backend:HFBackend",
    "vllm": "specdistill.feature_server.vllm_backend:VLLMBackend",
    # Random states of the target's shape, no model: times the trainer side of the pipeline (synthetic_backend.py).
    "synthetic": "specdistill.feature_server.synthetic_backend:SyntheticBackend",
}


class FeatureBackend(ABC):
    """Built once per worker process. `extract` returns, per row, hidden_TLD = [T, len(spec.layer_ids), D]
    in spec.hidden_dtype on CPU (fp8: the values the trainer gets, in fp32: core/contract.py shipped_values), layers
    in spec.layer_ids order (vLLM layer-id convention, see specdistill/core/contract.py)."""

    def __init__(self, target_dir: str, spec: FeatureSpec, device: str = "cpu", dtype: str | None = None,
                 batch_tokens: int | None = None, max_row_tokens: int | None = None):
        # batch_tokens: tokens per prefill call a batching backend may run at once; max_row_tokens: the longest row
        # it will be handed (None = the target's context). A backend that prefills row by row ignores both.
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

    def row_states(self, rows: list[TokenizedRow]) -> list[torch.Tensor]:
        """Per row, states [T, len(spec.layer_ids), D] of every position wherever the backend holds them (a GPU
        backend: on the device, so that publish cuts them to what ships before the copy to the host). Default:
        extract()'s."""
        return self.extract(rows)

    def publish(self, rows: list[TokenizedRow], producer: ShmProducer, info: dict) -> None:
        """Publish each row's sample (sample_tensors: the positions the spec ships) through `producer`, with `info`
        and the per-row extraction seconds (`extract_s`) in its message. This default cuts row_states()'s tensors
        and copies them into the ring; a backend whose target can write into a reserved region itself overrides it
        (vllm_backend.py)."""
        t0 = time.perf_counter()
        states = self.row_states(rows)
        extract_s = (time.perf_counter() - t0) / max(1, len(rows))
        if len(states) != len(rows):
            raise RuntimeError(f"backend returned {len(states)} hidden states for {len(rows)} rows")
        for row, states_TLD in zip(rows, states):
            producer.put(row.row_id, sample_tensors(row, states_TLD, self.spec), info={**info, "extract_s": extract_s})

    def close(self) -> None:
        """Release engine resources (processes, GPU memory); the default has none."""


def sample_layout(row: TokenizedRow, spec: FeatureSpec, hidden_size: int) -> dict[str, tuple]:
    """The fields of one row's sample as they cross to the trainer: name -> (dtype, shape) (ledger.py checks them).
    Token ids and the loss mask cover the whole row; the states only the positions the spec ships, each states
    field followed by its scales where the states are fp8."""
    T = row.num_tokens
    spans = spec.row_spans(row.loss_mask)
    layout = {"input_ids_T": (torch.int64, (T,)), "loss_mask_T": (torch.bool, (T,))}
    shipped = [(T - spans.context_start, spec.context_layer_ids), (T - spans.response_start, spec.response_layer_ids)]
    for (states, scale), (positions, layers) in zip(STATES_FIELDS, shipped):
        if layers:
            layout[states] = (spec.torch_dtype, (positions, len(layers), hidden_size))
            if spec.scaled:
                layout[scale] = (SCALE_DTYPE, (positions, len(layers)))
    return layout


def sample_tensors(row: TokenizedRow, states_TLD: torch.Tensor, spec: FeatureSpec) -> dict[str, torch.Tensor]:
    """One row's sample, laid out as sample_layout says, from its states of every position: cut and cast (fp8:
    quantised) where they are (a GPU backend's device), then moved to the host."""
    out = {"input_ids_T": torch.tensor(row.input_ids, dtype=torch.int64),
           "loss_mask_T": torch.tensor(row.loss_mask, dtype=torch.bool)}
    for (field, _), states in zip(STATES_FIELDS, cut_states(states_TLD, spec, spec.row_spans(row.loss_mask))):
        if states is not None:
            out |= {name: t.cpu() for name, t in encode_states(field, states, spec.hidden_dtype).items()}
    return out


def check_row(row: TokenizedRow, vocab_size: int) -> None:
    """Reject a row the target cannot prefill, naming the row and what was expected."""
    T = len(row.input_ids)
    if T == 0:
        raise ValueError(f"row {row.row_id}: no tokens")
    if len(row.loss_mask) != T:
        raise ValueError(f"row {row.row_id}: loss_mask has {len(row.loss_mask)} entries, input_ids has {T}")
    if 0 <= min(row.input_ids) and max(row.input_ids) < vocab_size:
        return
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


def build_backend(name: str, target_dir: str, spec: FeatureSpec, device: str = "cpu", dtype: str | None = None,
                  batch_tokens: int | None = None, max_row_tokens: int | None = None) -> FeatureBackend:
    return resolve_backend(name)(target_dir, spec, device=device, dtype=dtype, batch_tokens=batch_tokens,
                                 max_row_tokens=max_row_tokens)
