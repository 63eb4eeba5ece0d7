"""Running training metrics: per-position accuracy against the target, and an estimated tau."""

import torch

from specdistill.trainer import distributed


class StepMetrics:
    def __init__(self, K: int):
        self.correct_K = torch.zeros(K, dtype=torch.float64)
        self.total_K = torch.zeros(K, dtype=torch.float64)
        self.accepted = torch.zeros((), dtype=torch.float64)
        self.blocks = torch.zeros((), dtype=torch.float64)

    def add(self, out) -> None:
        self.correct_K += out.correct_K.detach().cpu().double()
        self.total_K += out.total_K.detach().cpu().double()
        self.accepted += out.accepted_prefix_sum.detach().cpu().double()
        self.blocks += out.blocks.detach().cpu().double()

    def reduced(self, ctx) -> "StepMetrics":
        """Summed over ranks (all ranks must call it)."""
        if not ctx.enabled:
            return self
        flat = torch.cat([self.correct_K, self.total_K, self.accepted[None], self.blocks[None]]).to(ctx.device)
        flat = distributed.all_reduce_sum(flat, ctx).cpu()
        K = self.correct_K.shape[0]
        out = StepMetrics(K)
        out.correct_K, out.total_K, out.accepted, out.blocks = flat[:K], flat[K:2 * K], flat[2 * K], flat[2 * K + 1]
        return out

    @property
    def tau_estimate(self) -> float:
        """1 + mean accepted prefix per block, with blocks anchored anywhere in the response."""
        return 1.0 + float(self.accepted / self.blocks) if self.blocks > 0 else float("nan")

    def summary(self) -> dict:
        acc = (self.correct_K / self.total_K.clamp(min=1)).tolist()
        return {"accuracy_per_position": acc, "tau_estimate": self.tau_estimate}
