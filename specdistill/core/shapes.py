"""The few shapes compiled attention sees in a run (docs/scaling.md, "Compiled shapes").

Compiled flex attention (specdistill/kernels/attention/flex.py) is specialised to the shapes of its inputs and of
the tensors its mask captures: every new pack length or anchor count would compile it again, and past torch's
recompile limit the call would run uncompiled, materialising [heads, queries, keys] scores (flex.py stops the run with
an error there instead). So on CUDA a run lays every
pack out over `trainer.token_budget` tokens (the rest a padding document no row maps to, without loss) and the
attention plans pad their query blocks to a bucket of anchor counts; the drafters' outputs and losses are those of
the unpadded pack (tests/drafters/test_static_shapes.py, tests/kernels/test_attention.py).

A StaticShapes object goes with each pack (`PackedBatch.static`): the attention plans read the bucket sizes from it
and record every shape they give a compiled path, so a run can report how many it planned (`compiled_shapes` in
metrics.json, per drafter; beside it, `compiled_graphs` counts the graphs dynamo really compiled, once for the run).
With `pad=False` (CPU, where nothing is compiled) nothing is padded and the shapes recorded are the ones padding would
give.
"""

from dataclasses import dataclass, field

import torch

# Anchor-count buckets: 16 x {1, 1.5} x 2^k. A bucket wastes under a third of its query blocks on average (at most
# half), and a count up to 1,024 (drafters' max_anchors) falls in one of 13 buckets; a pack of the mission's ~270
# response tokens pays for 384 anchors, not 1,024.
_BUCKET_BASE = 16


def anchor_bucket(n: int) -> int:
    """The smallest bucket >= n (>= 16): 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, ..."""
    low = _BUCKET_BASE
    while True:
        if n <= low:
            return low
        if n <= low * 3 // 2:
            return low * 3 // 2
        low *= 2


@dataclass
class StaticShapes:
    """tokens: the length every pack (and held-out walk) is laid out over, trainer.token_budget.
    pad: pad for real (compiled attention, CUDA), or only record the shapes padding would give (CPU)."""

    tokens: int
    pad: bool
    seen: set = field(default_factory=set)  # the shapes recorded: (plan kind, query length, key length, ...)
    real_queries: int = 0  # anchor-block queries of the plans built (real ones, and with their padding)
    laid_out_queries: int = 0

    def anchors(self, n: int) -> int:
        return anchor_bucket(n)

    def walk_tokens(self, n: int) -> int:
        """The length a held-out walk of one n-position row is laid out over: a bucket (16 x {1, 1.5} x 2^k, as
        anchors), at most the pack's. Rows of the mission (~2.1k positions shipped for a windowed drafter) pay
        for 3,072, not 32,768, and the walks add a few shapes per anchor bucket."""
        return min(max(anchor_bucket(n), n), max(self.tokens, n))

    def record(self, *key) -> None:
        # A shape is compiled once for training and once more for the held-out walks (no autograd there).
        self.seen.add((*key, torch.is_grad_enabled()))

    def count_queries(self, real: int, padded: int) -> None:
        self.real_queries += real
        self.laid_out_queries += padded

    @property
    def query_pad_fraction(self) -> float:
        return 1 - self.real_queries / self.laid_out_queries if self.laid_out_queries else 0.0

    @property
    def count(self) -> int:
        return len(self.seen)
