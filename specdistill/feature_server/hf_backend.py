"""Target hidden states from a transformers checkpoint: prefill only, one row at a time.

One row per forward and no padding: left/right padding corrupts the recurrent state of gated-DeltaNet
(linear-attention) layers in hybrid targets, and rows vary in length anyway. No KV cache, inference_mode.

Layer ids follow vLLM (specdistill/core/contract.py): id k < L is captured as the *input* of decoder layer k (the residual stream
after k layers; k = 0 is the embedding output) and id L as the input of the final norm. transformers' last
`hidden_states` entry is post-norm, so it is never used. When the largest id is < L the forward stops there.

Legend: T tokens, L requested layers (stacked), D hidden size.
"""

from functools import partial
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from specdistill.core.contract import DTYPES, FeatureSpec, TokenizedRow, shipped_values
from specdistill.feature_server.backends import FeatureBackend, check_row

# Architectures whose decoder (model.model.layers + model.model.norm, plain residual stream from
# embed_tokens) matches the layer-id semantics above. qwen3_5_moe checkpoints are text+vision composites;
# AutoModelForCausalLM builds their text-only causal LM (qwen3_5_moe_text is that text part saved alone).
SUPPORTED_MODEL_TYPES = ("llama", "qwen3", "qwen3_moe", "qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text")


class _StopForward(Exception):
    """Raised by the hook of the deepest requested layer: nothing after it is needed."""


class HFBackend(FeatureBackend):
    def __init__(self, target_dir: str, spec: FeatureSpec, device: str = "cpu", dtype: str | None = None,
                 batch_tokens: int | None = None, max_row_tokens: int | None = None):
        super().__init__(target_dir, spec, device, dtype)  # one row per forward: no batch, no engine context
        config = _load_config(target_dir)
        text_config = config.get_text_config()
        self._num_layers = text_config.num_hidden_layers
        self._hidden = text_config.hidden_size
        self.vocab_size = text_config.vocab_size
        spec.check_against(self._num_layers)  # before loading weights: fail fast
        self.model = AutoModelForCausalLM.from_pretrained(
            target_dir, local_files_only=True, dtype=_torch_dtype(dtype)).to(device).eval()
        self._decoder = self.model.model
        self._captured: dict[int, torch.Tensor] = {}
        self._install_hooks()

    @property
    def num_hidden_layers(self) -> int:
        return self._num_layers

    @property
    def hidden_size(self) -> int:
        return self._hidden

    def extract(self, rows: list[TokenizedRow]) -> list[torch.Tensor]:
        return [shipped_values(states, self.spec).cpu() for states in self.row_states(rows)]

    def row_states(self, rows: list[TokenizedRow]) -> list[torch.Tensor]:
        """On the model's device: a worker cuts them to what ships before they cross to the host (backends.py)."""
        return [self._row_states(row) for row in rows]

    def _row_states(self, row: TokenizedRow) -> torch.Tensor:
        check_row(row, self.vocab_size)
        captured = self._prefill(row)
        return torch.stack([captured[k][0] for k in self.spec.layer_ids], dim=1)

    @torch.inference_mode()
    def _prefill(self, row: TokenizedRow) -> dict[int, torch.Tensor]:
        ids_1T = torch.tensor([row.input_ids], dtype=torch.long, device=self.device)
        self._captured = {}
        try:
            self._decoder(input_ids=ids_1T, use_cache=False)
        except _StopForward:
            pass
        missing = [k for k in self.spec.layer_ids if k not in self._captured]
        if missing:
            raise RuntimeError(f"row {row.row_id}: layer ids {missing} were not captured by the forward hooks")
        return self._captured

    def _install_hooks(self) -> None:
        layers, norm = getattr(self._decoder, "layers", None), getattr(self._decoder, "norm", None)
        if layers is None or norm is None or len(layers) != self._num_layers:
            raise TypeError(f"{self.target_dir}: expected model.model.layers ({self._num_layers} decoder layers) "
                            f"and model.model.norm, found {type(self._decoder).__name__}")
        last_id = self.spec.layer_ids[-1]
        for k in self.spec.layer_ids:
            module = norm if k == self._num_layers else layers[k]
            module.register_forward_pre_hook(partial(self._capture, k, k == last_id), with_kwargs=True)

    def _capture(self, layer_id: int, stop: bool, module, args, kwargs):
        self._captured[layer_id] = args[0] if args else kwargs["hidden_states"]
        if stop and layer_id < self._num_layers:
            raise _StopForward


def _load_config(target_dir: str):
    if not (Path(target_dir) / "config.json").is_file():
        raise FileNotFoundError(f"target_dir {target_dir}: no config.json (expected a local transformers checkpoint)")
    config = AutoConfig.from_pretrained(target_dir, local_files_only=True)
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"{target_dir}: model_type {config.model_type!r} is not supported by the hf feature "
                         f"backend; supported: {list(SUPPORTED_MODEL_TYPES)}")
    return config


def _torch_dtype(dtype: str | torch.dtype | None):
    if dtype is None:
        return "auto"  # the checkpoint config's dtype
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} not in {sorted(DTYPES)} (or None for the checkpoint's own)")
    return DTYPES[dtype]
