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

from specdistill.core.batch import PackedBatch
from specdistill.core.contract import FeatureSpec, TokenizedRow
from specdistill.core.target import TargetHead, TargetInfo


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


# trainer.compute: "read" computes only what a loss, a metric or a served draft reads (e.g. EAGLE-3's last layer at
# chain anchors only, DFlash's fc and K/V only where a window reaches); "all" computes every position of the pack,
# the reference the exactness tests compare "read" with. Both give the same losses, metrics and gradients.
COMPUTE_MODES = ("read", "all")


class Drafter(nn.Module, ABC):
    """A trainable draft head. Weights of the target (embeddings, lm_head) live in TargetHead, not here."""

    name: str  # registry key, what users type: drafter=NAME
    compute: str = "read"  # COMPUTE_MODES; the trainer sets it from trainer.compute

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
        """What this head needs from the target: its layers and the positions of each it can read (the feature
        server reads only this, merged over a run's drafters: FeatureSpec.union). hidden_dtype is the run's."""

    def input_layer_ids(self) -> list[int]:
        """The target layers the drafter reads as inputs (the rest of feature_spec() serves the target's own
        distribution). Default: `target_layer_ids`."""
        return list(self.target_layer_ids)

    def adamw_matrices(self) -> list[nn.Parameter]:
        """2-D parameters that are not hidden-layer maps, trained by AdamW instead of Muon (trainer.muon_scope):
        torch.optim.Muon is meant for hidden-layer matrices. Its orthogonalised update has a fixed size whatever
        the gradient and spreads over every row, so a token table would move the rows of tokens the batch never
        saw, and a zero-initialised dynamic gate drifts away from identity (docs/quality.md, "Muon on tables,
        heads and gates"). Default: every nn.Embedding's table; drafters add vocabulary heads and such gates."""
        return [m.weight for m in self.modules() if isinstance(m, nn.Embedding) and m.weight.requires_grad]

    @abstractmethod
    def training_step(self, batch: PackedBatch, head: TargetHead, generator: torch.Generator) -> StepOutput:
        """Loss and metrics on one packed batch."""

    @abstractmethod
    def propose(self, batch: PackedBatch, head: TargetHead, anchors_N: torch.Tensor) -> torch.Tensor:
        """Greedy drafts [N, K] for anchors (positions of the last verified token), as served."""

    @abstractmethod
    def draft_logits(self, batch: PackedBatch, head: TargetHead, anchors_N: torch.Tensor) -> torch.Tensor:
        """Draft logits [N, K, V] over the target vocabulary (-inf outside a reduced draft vocabulary): the draft
        distribution q that sampled drafting at T > 0 draws from (specdistill/evaluation/acceptance.py). Slot k's
        serving-time logits with the earlier slots fed the row's tokens (teacher-forced), so argmax ==
        propose() wherever the earlier drafts equal the row."""

    @abstractmethod
    def export(self, out_dir: Path, target: TargetInfo) -> None:
        """Write a directory the serving engine loads (speculators format or a target copy)."""

    # --- warm start (specdistill/drafters/warm_start.py) ---------------------------------------------------------------
    @classmethod
    def architecture_from_export(cls, config: dict) -> dict:
        """The config fields an export's config.json fixes (drafter.init_from). Default: none."""
        return {}

    def load_export(self, path: Path) -> None:
        """Replace the fresh weights with an export's (after prepare())."""
        from specdistill.drafters.warm_start import load_weights

        load_weights(self, path)


def reads(input_layer_ids, num_hidden_layers: int, context_window: int | None) -> FeatureSpec:
    """The FeatureSpec of a drafter that takes `input_layer_ids` as inputs over `context_window` tokens before its
    first anchor (None: whole rows) and the last layer (num_hidden_layers) for the target's distribution of its
    labels: that layer ships only at response positions unless it is an input too (core/contract.py)."""
    last = num_hidden_layers
    layer_ids = tuple(sorted(set(input_layer_ids) | {last}))
    return FeatureSpec(layer_ids, context_window=context_window,
                       response_layer_ids=() if last in input_layer_ids else (last,))


def block_metrics(loss: torch.Tensor, correct_NK: torch.Tensor, valid_NK: torch.Tensor) -> StepOutput:
    """Per-position accuracy and the accepted-prefix length of each block whose first slot is scored."""
    scored = valid_NK[:, 0]
    accepted = torch.cumprod((correct_NK & valid_NK).long(), dim=1).sum(1)
    return StepOutput(
        loss=loss,
        correct_K=(correct_NK & valid_NK).sum(0),
        total_K=valid_NK.sum(0),
        accepted_prefix_sum=accepted[scored].sum(),
        blocks=scored.sum(),
    )


def _token_id(tokenizer, token: str | None) -> int | None:
    if not token:
        return None
    token_id = tokenizer.convert_tokens_to_ids(token)
    if token_id is None or (token_id == tokenizer.unk_token_id and token != tokenizer.unk_token):
        return None
    return token_id


def choose_mask_token(tokenizer, vocab_size: int, configured: str, field_name: str) -> tuple[int, str]:
    """(id, why) of the token block drafters put in their draft slots; its embedding comes from the target.

    In order: the configured token, the tokenizer's own mask token, the first embedding row the tokenizer never
    emits (tables are padded past the tokenizer: Qwen's 248,320 rows hold ~248k tokens), the pad token when it is
    not eos, else the last token of the vocabulary. Any id works (the drafter learns the slot's meaning; vLLM
    fills the slots with whatever `mask_token_id` the export names); a spare one just never collides with an
    anchor."""
    if (token_id := _token_id(tokenizer, configured)) is not None:
        return token_id, f"{field_name}={configured!r}"
    if (token_id := _token_id(tokenizer, tokenizer.mask_token)) is not None:
        return token_id, f"the tokenizer's mask token {tokenizer.mask_token!r}"
    if len(tokenizer) < vocab_size:
        return len(tokenizer), f"embedding row {len(tokenizer)}, which the tokenizer never emits"
    pad = tokenizer.pad_token_id
    if pad is not None and pad != tokenizer.eos_token_id:
        return pad, f"the pad token {tokenizer.pad_token!r}"
    last = min(len(tokenizer), vocab_size) - 1
    return last, f"the last vocabulary id ({tokenizer.convert_ids_to_tokens(last)!r}; no spare token exists)"


def sample_anchors(candidates_C: torch.Tensor, max_anchors: int, generator: torch.Generator) -> torch.Tensor:
    """At most max_anchors of the candidate positions, uniformly without replacement, in ascending order."""
    if candidates_C.numel() <= max_anchors:
        return candidates_C
    pick = torch.randperm(candidates_C.numel(), generator=generator)[:max_anchors]
    return candidates_C[pick.to(candidates_C.device)].sort().values


def export_dtype(target: TargetInfo) -> torch.dtype:
    """Exports are written in the target's dtype (vLLM serves the drafter in it)."""
    return {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(target.torch_dtype, torch.float32)


def proposal_tokens(config: dict) -> int:
    """K of a speculators-format config.json (its default proposal method's speculative_tokens)."""
    block = config["speculators_config"]
    methods = {m["proposal_type"]: m for m in block["proposal_methods"]}
    return int(methods.get(block.get("default_proposal_method"), block["proposal_methods"][0])["speculative_tokens"])


def speculators_block(algorithm: str, num_speculative_tokens: int, target: TargetInfo) -> dict:
    """The `speculators_config` entry of a speculators-format config.json: greedy proposal of K tokens."""
    return {
        "algorithm": algorithm,
        "proposal_methods": [
            {"proposal_type": "greedy", "speculative_tokens": num_speculative_tokens,
             "accept_tolerance": 0.0, "verifier_accept_k": 1}
        ],
        "default_proposal_method": "greedy",
        "verifier": {"name_or_path": str(target.path.resolve()), "architectures": list(target.architectures)},
    }
