"""Muon for 2-D weight matrices, AdamW for everything else, one linear warm-up/decay schedule."""

import torch
from torch import nn

from trainer.config import TrainerConfig


def lr_factor(step: int, cfg: TrainerConfig) -> float:
    """Linear warm-up to 1, then linear decay to final_lr_fraction at max_steps."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    span = max(1, cfg.max_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return 1.0 - (1.0 - cfg.final_lr_fraction) * progress


class Optimizers:
    """The two optimizers stepped, zeroed, scheduled and checkpointed as one."""

    def __init__(self, model: nn.Module, cfg: TrainerConfig):
        params = [p for p in model.parameters() if p.requires_grad]
        matrices = [p for p in params if p.ndim == 2]
        others = [p for p in params if p.ndim != 2]
        self.cfg = cfg
        self.optimizers: list[torch.optim.Optimizer] = []
        if matrices:
            self.optimizers.append(torch.optim.Muon(matrices, lr=cfg.muon_lr, weight_decay=cfg.weight_decay,
                                                    adjust_lr_fn="match_rms_adamw"))
        if others:
            self.optimizers.append(torch.optim.AdamW(others, lr=cfg.lr, weight_decay=0.0, betas=(0.9, 0.95)))
        for opt in self.optimizers:
            for group in opt.param_groups:
                group["initial_lr"] = group["lr"]

    def set_step(self, step: int) -> float:
        factor = lr_factor(step, self.cfg)
        for opt in self.optimizers:
            for group in opt.param_groups:
                group["lr"] = group["initial_lr"] * factor
        return factor

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)

    def state_dict(self) -> list[dict]:
        return [opt.state_dict() for opt in self.optimizers]

    def load_state_dict(self, states: list[dict]) -> None:
        if len(states) != len(self.optimizers):
            raise ValueError(f"checkpoint has {len(states)} optimizer states, this model needs {len(self.optimizers)}")
        for opt, state in zip(self.optimizers, states):
            opt.load_state_dict(state)
