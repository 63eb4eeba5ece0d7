"""The one interface every drafter head implements.

The trainer never branches on a drafter's name: what differs between heads is a method here.
Legend for tensor suffixes: T packed tokens, L target layers, D hidden, N anchors, K draft tokens.
"""

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from feature_server.contract import FeatureSpec, TokenizedRow
from trainer.batch import PackedBatch
from trainer.target import TargetHead, TargetInfo


@dataclass
class StepOutput:
    loss: torch.Tensor  # scalar, differentiable
    # Per draft position k = 1..K: how many positions were scored and how many matched the target.
    correct_K: torch.Tensor
    total_K: torch.Tensor
    # Blocks scored and the sum of their accepted-prefix lengths (for an estimated tau).
    accepted_prefix_sum: torch.Tensor
    blocks: torch.Tensor
    extra: dict[str, float] = field(default_factory=dict)


class Drafter(nn.Module, ABC):
    """A trainable draft head. Weights of the target (embeddings, lm_head) live in TargetHead, not here."""

    name: str  # registry key, what users type: drafter=NAME

    @classmethod
    @abstractmethod
    def build(cls, cfg, target: TargetInfo, tokenizer) -> "Drafter":
        """Construct from its config dataclass, the target's facts and the target's tokenizer."""

    def prepare(self, rows: Sequence[TokenizedRow]) -> None:
        """Data-dependent setup before training (e.g. EAGLE-3's draft vocabulary); must be deterministic
        in `rows`, since a resumed run calls it again before loading its checkpoint. Default: nothing."""

    def forward(self, batch: PackedBatch, head: TargetHead, generator: torch.Generator) -> StepOutput:
        # forward() is the training step so that DDP's gradient hooks see it.
        return self.training_step(batch, head, generator)

    @property
    @abstractmethod
    def num_speculative_tokens(self) -> int:
        """K: draft tokens proposed per verification step when served."""

    @abstractmethod
    def feature_spec(self) -> FeatureSpec:
        """What this head needs from the target (the feature server reads only this)."""

    @abstractmethod
    def training_step(self, batch: PackedBatch, head: TargetHead, generator: torch.Generator) -> StepOutput:
        """Loss and metrics on one packed batch."""

    @abstractmethod
    def propose(self, batch: PackedBatch, head: TargetHead, anchors_N: torch.Tensor) -> torch.Tensor:
        """Greedy drafts [N, K] for anchors (positions of the last verified token), as served."""

    @abstractmethod
    def export(self, out_dir: Path, target: TargetInfo) -> None:
        """Write a directory the serving engine loads (speculators format or a target copy)."""


def resolve_token_id(tokenizer, token: str, field_name: str) -> int:
    """Id of a (special) token of the target's tokenizer, or an error saying which field to change."""
    token_id = tokenizer.convert_tokens_to_ids(token)
    if token_id is None or (token_id == tokenizer.unk_token_id and token != tokenizer.unk_token):
        raise ValueError(
            f"{field_name}={token!r} is not a token of the target's tokenizer; "
            f"set {field_name} to one of its special tokens, e.g. {tokenizer.all_special_tokens[:12]}"
        )
    return token_id
