"""Process-group setup for torchrun (and Ray train workers, which set the same env variables).

Drafters stay single-device modules; specdistill/trainer/parallel.py spreads them over the ranks (DDP or FSDP2). nccl on
CUDA, gloo on CPU.
"""

import datetime
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def resolve_device(name: str, local_rank: int) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("trainer.device=cuda but no CUDA device is visible; use trainer.device=cpu")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device(name)


def init_distributed(device_name: str, timeout_s: float = 1800) -> DistContext:
    """torchrun's env -> one process group. `timeout_s` bounds every collective: a rank whose peer died or
    diverged raises after it instead of hanging, so the launcher (specdistill/launch/ranks.py, torchrun, specdistill.launch.ray_job)
    stops the job."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(device_name, local_rank)
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo",
                                timeout=datetime.timedelta(seconds=timeout_s))
    return DistContext(rank, world_size, local_rank, device)


def all_reduce_sum(t: torch.Tensor, ctx: DistContext) -> torch.Tensor:
    if ctx.enabled:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def all_ranks(flag: bool, ctx: DistContext) -> bool:
    """True when `flag` is true on every rank (one tiny all-reduce)."""
    if not ctx.enabled:
        return flag
    t = torch.tensor([int(flag)], device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def gather_objects(obj, ctx: DistContext) -> list:
    """Every rank's `obj` (picklable), in rank order, on every rank."""
    if not ctx.enabled:
        return [obj]
    out = [None] * ctx.world_size
    dist.all_gather_object(out, obj)
    return out


def barrier(ctx: DistContext) -> None:
    if ctx.enabled:
        dist.barrier()


# How long close() lets gloo's worker threads finish with their last collective before the group goes away.
_SETTLE_S = 1.0


def close(ctx: DistContext) -> None:
    """Destroy the process group, after the last collective of this rank (safe to call twice).

    gloo's worker thread releases a finished collective's tensors a moment after the caller's wait() returned, and
    releasing a tensor that Python already dropped takes the GIL. The group's destructor, which runs when its last
    owner (DDP's reducer, FSDP's mesh) is freed, joins those threads while holding the GIL. If it comes first,
    both wait forever: seen on rank 1 of a 2-rank CPU run, whose last all-reduce was a few ms before its exit
    (the thread stuck in take_gil inside ~AsyncAllreduceWork, the main thread in ~ProcessGroupGloo's join). A
    sleep releases the GIL, so the threads finish first; 1 s, because on busy cores a thread can wait long to run."""
    if ctx.enabled and dist.is_initialized():
        time.sleep(_SETTLE_S)
        dist.destroy_process_group()
