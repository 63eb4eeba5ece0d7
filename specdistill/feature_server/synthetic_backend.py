"""Synthetic target states: the feature path without a model, for timing the pipeline (bench/drafter_steps.py --fed).

`feature_server.backend=synthetic` reads only the target's config.json (hidden size, layer count) and publishes,
for each row, states of the right shape and dtype cut from one random buffer drawn once per worker: the worker's
cost per row is the one copy into its shared-memory ring that a real backend's hand-off also makes (the vLLM
connector writes the states there; with fp8 states, also their quantisation), so the trainer side (ring -> pack ->
device -> step) is measured as a run takes it, at whatever feature supply the workers then reach. The states carry
no information: a drafter trained on them learns nothing, and the trainer side does not look.
"""

import json
from pathlib import Path

import torch

from specdistill.core.contract import FeatureSpec, TokenizedRow, shipped_values
from specdistill.feature_server.backends import FeatureBackend

MAX_ROW_TOKENS = 32768  # the buffer covers rows up to this long unless max_row_tokens says otherwise


class SyntheticBackend(FeatureBackend):
    def __init__(self, target_dir: str, spec: FeatureSpec, device: str = "cpu", dtype: str | None = None,
                 batch_tokens: int | None = None, max_row_tokens: int | None = None):
        super().__init__(target_dir, spec, device, dtype)
        config = json.loads((Path(target_dir) / "config.json").read_text())
        config = config.get("text_config", config)
        self._num_layers, self._hidden = int(config["num_hidden_layers"]), int(config["hidden_size"])
        spec.check_against(self._num_layers)
        rows = max_row_tokens or MAX_ROW_TOKENS
        g = torch.Generator().manual_seed(0)
        # fp8 states are quantised per row as they are published (backends.py sample_tensors), as a real worker's
        # are: the buffer holds what a target would give, bf16.
        dtype = torch.bfloat16 if spec.scaled else spec.torch_dtype
        self._states_TLD = torch.randn(rows, len(spec.layer_ids), self._hidden, generator=g).to(dtype)

    @property
    def num_hidden_layers(self) -> int:
        return self._num_layers

    @property
    def hidden_size(self) -> int:
        return self._hidden

    def extract(self, rows: list[TokenizedRow]) -> list[torch.Tensor]:
        return [shipped_values(states, self.spec) for states in self.row_states(rows)]

    def row_states(self, rows: list[TokenizedRow]) -> list[torch.Tensor]:
        longest = self._states_TLD.shape[0]
        for row in rows:
            if row.num_tokens > longest:
                raise ValueError(f"row {row.row_id}: {row.num_tokens} tokens, longer than the synthetic backend's "
                                 f"{longest}-token buffer (max_row_tokens)")
        return [self._states_TLD[: row.num_tokens] for row in rows]  # views: the ring copy is the only one
