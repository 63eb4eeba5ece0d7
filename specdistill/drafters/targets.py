"""The target's side of a training step's losses, formed once per distinct scored position.

One position is scored by several rows of a step: EAGLE-3's chain step s of the anchor at a predicts a + 1 + s, so up
to ttt_steps chains score it; a DFlash-family block slot k of the anchor at a scores a + k, so up to K blocks do.
DistinctTargets computes the target's final-normed state at each distinct position, its greedy token over the whole
vocabulary, and (within TARGET_LOGITS_BUDGET) its logits over the loss's vocabulary once, not once per row and again
in the chunked loss's backward recompute (specdistill/kernels/logits/chunked.py): every chunked_loss call of the step
gathers its rows from them (measured on small-real's demo rows for EAGLE-3: 11% of a CPU step went to the target's
logits, 6% to its argmax).
Suffixes: M scored rows, U distinct positions (sorted), D hidden, V the loss's vocabulary.
"""

from collections.abc import Callable
from functools import cached_property

import torch
import torch.nn.functional as F

from specdistill.core.target import TargetHead

# [positions, vocabulary] target logits a step may keep (bytes); above it they are formed per row, in each chunk.
TARGET_LOGITS_BUDGET = 1 << 30


class DistinctTargets:
    """states_at(positions_U) -> the target's last-layer states there [U, D] (pre-norm, as the pack carries them).
    vocab_ids: the loss's vocabulary as target ids (EAGLE-3's draft vocabulary; None: the whole one).
    keep_logits=False never keeps the logits: each row forms its own in every chunk, forward and backward (what a
    drafter's compute='all' reference does, specdistill/drafters/base.py COMPUTE_MODES)."""

    def __init__(self, head: TargetHead, states_at: Callable[[torch.Tensor], torch.Tensor], positions_M: torch.Tensor,
                 vocab_ids: torch.Tensor | None = None, keep_logits: bool = True):
        self.head = head
        self.states_U, self.rows_M = torch.unique(positions_M, return_inverse=True)
        W = head.lm_head.weight
        with torch.no_grad():
            self.last_UD = states_at(self.states_U)
            self.normed_UD = head.norm(self.last_UD.to(W.dtype))
            self.weight_VD = W if vocab_ids is None else W[vocab_ids]
            size = self.states_U.numel() * self.weight_VD.shape[0] * self.normed_UD.element_size()
            self.logits_UV = (F.linear(self.normed_UD, self.weight_VD)
                              if keep_logits and size <= TARGET_LOGITS_BUDGET else None)

    @cached_property
    def argmax_U(self) -> torch.Tensor:
        """The target's greedy token at each distinct position, over its whole vocabulary."""
        return self.head.argmax(self.last_UD)

    def index(self, positions_M: torch.Tensor) -> torch.Tensor:
        """Rows of states_U for pack positions (each one of the positions given)."""
        return torch.searchsorted(self.states_U, positions_M)

    def loss_args(self, u_M: torch.Tensor | None = None) -> dict:
        """chunked_loss's target arguments for rows u_M (default: the positions given, in their order): the kept
        logits, or the normed states to form them from."""
        u_M = self.rows_M if u_M is None else u_M
        if self.logits_UV is not None:  # shared by every call of the step: no [M, V] copy per call
            return {"target_logits_UV": self.logits_UV, "target_rows_M": u_M}
        return {"target_hidden_MD": self.normed_UD[u_M], "target_weight_VD": self.weight_VD}
