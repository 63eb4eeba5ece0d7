"""How the drafter is spread over the trainer ranks: `trainer.parallel=ddp` (replicated weights, all-reduced
gradients) or `fsdp` (FSDP2: weights, gradients and optimizer states sharded over the ranks).

Everything the trainer does that depends on the mode lives here: wrapping, skipping the gradient sync on
accumulation micro-batches, and the model/optimizer state that goes into a checkpoint. Checkpoints hold full
(unsharded) tensors in both modes, keyed by parameter name (torch.distributed.checkpoint.state_dict), so a run
saved under one mode or rank count resumes under another.
"""

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.nn.parallel import DistributedDataParallel

from specdistill.trainer.distributed import DistContext

MODES = ("ddp", "fsdp")
_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"trainer.parallel={mode!r}; valid: {', '.join(MODES)}")


def wrap(drafter: nn.Module, mode: str, ctx: DistContext) -> nn.Module:
    """The module the training step calls. fsdp shards each of `drafter.layers` as its own unit (its weights are
    gathered just before its forward and freed after), then the rest at the root; the drafter is changed in
    place, so `drafter` and the returned module are the same object."""
    check_mode(mode)
    if not ctx.enabled:
        return drafter
    if mode == "ddp":
        return DistributedDataParallel(drafter)
    from torch.distributed.fsdp import fully_shard

    for layer in getattr(drafter, "layers", ()):
        fully_shard(layer)
    fully_shard(drafter)
    return drafter


def optimizer_group(ctx: DistContext) -> dist.ProcessGroup | None:
    """The ranks Muon splits its Newton-Schulz over (specdistill/trainer/optim.py GatheredMuon): all of them, in
    either mode; None in a one-process run."""
    return dist.group.WORLD if ctx.enabled else None


def gradient_sync(model: nn.Module, mode: str, ctx: DistContext, sync: bool):
    """Context for one micro-batch's backward: gradients are reduced over the ranks only when `sync` (the last
    micro-batch of the step); the others accumulate locally."""
    if sync or not ctx.enabled:
        return contextlib.nullcontext()
    if mode == "ddp":
        return model.no_sync()
    return _fsdp_no_sync(model)


@contextlib.contextmanager
def _fsdp_no_sync(model):
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def model_state(drafter: nn.Module) -> dict:
    """Full weights and buffers on CPU; a collective under fsdp (every rank must call it)."""
    return get_model_state_dict(drafter, options=_FULL)


def load_model_state(drafter: nn.Module, state: dict) -> None:
    set_model_state_dict(drafter, state, options=StateDictOptions(full_state_dict=True, strict=True))


def optimizer_state(drafter: nn.Module, optimizers: list[torch.optim.Optimizer]) -> dict:
    """Every optimizer's full state keyed by parameter name; a collective under fsdp."""
    return get_optimizer_state_dict(drafter, optimizers, options=_FULL)


def load_optimizer_state(drafter: nn.Module, optimizers: list[torch.optim.Optimizer], state: dict) -> None:
    set_optimizer_state_dict(drafter, optimizers, state, options=StateDictOptions(full_state_dict=True))
