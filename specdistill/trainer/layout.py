"""Node layout: which device each trainer rank and each feature worker of one node gets.

Production node (specdistill/conf/layout/node.yaml): 8 GPUs = trainer.ranks (2) trainer GPUs + feature_server.workers (6)
vLLM workers, one GPU each; each local trainer rank owns workers // ranks of them and reads only their features
(node-local shared memory). On CPU (specdistill/conf/layout/cpu.yaml, the default here) everything runs on "cpu".
One GPU (specdistill/conf/layout/gpu1.yaml): feature_server.share_trainer_device=true puts each rank's workers on the rank's own
device, an explicit opt-in (the target's weights and activations then share that GPU's memory with the trainer's);
without it a layout that needs more devices than the node has is refused.
"""

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class NodeLayout:
    ranks: int  # trainer processes on this node
    workers: int  # feature workers on this node
    trainer_devices: tuple[str, ...]  # per local rank
    worker_devices: tuple[tuple[str, ...], ...]  # per local rank: its workers' devices

    @property
    def workers_per_rank(self) -> int:
        return self.workers // self.ranks


def plan_node(ranks: int, workers: int, trainer_device: str, worker_device: str, cuda_devices: int,
              share_trainer_device: bool = False) -> NodeLayout:
    """Assign devices; raise a clear error when the node has fewer devices than the layout asks for.

    share_trainer_device (feature_server.share_trainer_device): each rank's workers run on the rank's own device
    instead of devices of their own, so the whole loop fits one GPU (specdistill/conf/layout/gpu1.yaml)."""
    if ranks < 1 or workers < 1:
        raise ValueError(f"trainer.ranks={ranks} and feature_server.workers={workers} must both be >= 1")
    if workers % ranks:
        raise ValueError(f"feature_server.workers={workers} does not split evenly over trainer.ranks={ranks}: "
                         "each trainer rank reads the features of its own workers (workers % ranks must be 0)")
    per_rank = workers // ranks
    trainer_on_gpu = _on_cuda(trainer_device, cuda_devices)
    workers_on_gpu = _on_cuda(worker_device, cuda_devices)
    if share_trainer_device:
        _check_shareable(worker_device, workers_on_gpu, trainer_on_gpu)
        workers_on_gpu = False  # they need no device of their own
    need = (ranks if trainer_on_gpu else 0) + (workers if workers_on_gpu else 0)
    if need > cuda_devices:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        what = (f"{ranks} trainer ranks, each sharing its device with its {per_rank} feature worker(s)"
                if share_trainer_device else
                f"{ranks if trainer_on_gpu else 0} trainer ranks + {workers if workers_on_gpu else 0} feature "
                "workers, one device each")
        raise RuntimeError(
            f"node layout needs {need} CUDA devices ({what}), this machine has {cuda_devices}"
            + (f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else "")
            + "; lower trainer.ranks / feature_server.workers, run the workers on cpu, or put each rank's workers "
            "on its own GPU (layout=gpu1: feature_server.share_trainer_device=true)")
    trainer = tuple(f"cuda:{r}" if trainer_on_gpu else "cpu" for r in range(ranks))
    if share_trainer_device:
        return NodeLayout(ranks, workers, trainer, tuple((device,) * per_rank for device in trainer))
    first = ranks if trainer_on_gpu else 0
    worker = tuple(tuple(f"cuda:{first + r * per_rank + i}" if workers_on_gpu else "cpu" for i in range(per_rank))
                   for r in range(ranks))
    return NodeLayout(ranks, workers, trainer, worker)


def _check_shareable(worker_device: str, workers_on_gpu: bool, trainer_on_gpu: bool) -> None:
    """share_trainer_device: feature_server.device must not contradict the trainer's device (auto follows it)."""
    if worker_device != "auto" and workers_on_gpu != trainer_on_gpu:
        raise ValueError(f"feature_server.share_trainer_device=true puts the feature workers on the trainer's "
                         f"device ({'cuda' if trainer_on_gpu else 'cpu'}), but feature_server.device={worker_device}; "
                         "set feature_server.device to the trainer's (or auto), or drop share_trainer_device")


def _on_cuda(device: str, cuda_devices: int) -> bool:
    if device == "auto":
        return cuda_devices > 0
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r}: expected auto, cpu or cuda (the layout assigns the indices)")
    return device == "cuda"


def cuda_device_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def torchrun_sizes(ranks: int, workers: int, local_world_size: int | None, explicit: set[str]) -> tuple[int, int]:
    """(trainer.ranks, feature_server.workers) for a process started by torchrun (or specdistill/launch/ranks.py, or a Ray
    job), which says how many trainer processes share this node (LOCAL_WORLD_SIZE).

    A setting the user passed on the command line (`explicit`, dotted keys) stays as given (Trainer then reports
    a mismatch); otherwise ranks follow torchrun, and workers rise to the next multiple of ranks, so every rank
    reads at least one worker of its own. Outside torchrun (local_world_size None) nothing changes."""
    if local_world_size is None:
        return ranks, workers
    if "trainer.ranks" not in explicit:
        ranks = local_world_size
    if "feature_server.workers" not in explicit and ranks >= 1 and workers % ranks:
        workers = ranks * -(-workers // ranks)
    return ranks, workers


def cpu_threads(configured: int | None, trainer_device: str, ranks: int, cores: int | None = None) -> int | None:
    """CPU threads per trainer rank (None: leave torch's default, which a CUDA rank barely uses).

    On CPU the node's cores are split over its trainer ranks (torch would give each rank all of them). The CPU
    feature workers share those cores: they are busy only while extracting ahead of the step, and with OpenMP's
    passive wait policy (specdistill/launch/train.py sets OMP_WAIT_POLICY=PASSIVE) a rank whose thread is preempted by a
    worker loses that thread's share, not the whole op. Measured on 2 cores (docs/scaling.md, "CPU threads"):
    a 2-layer DFlash step beside a worker busy 30% of the time took 4.1 s with 2 passive threads, 30 s with 2
    spinning ones (the default policy) and 10 s with 1 thread."""
    if configured is not None:
        if configured < 1:
            raise ValueError(f"trainer.threads={configured}: need >= 1 (or leave it unset)")
        return configured
    if trainer_device != "cpu":
        return None
    cores = cores or len(os.sched_getaffinity(0))
    return max(1, cores // ranks)
