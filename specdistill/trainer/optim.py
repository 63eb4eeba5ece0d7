"""Muon for hidden-layer weight matrices, AdamW for everything else (vectors, and the token tables, vocabulary heads
and dynamic gates a drafter declares in adamw_matrices), one linear warm-up/decay schedule."""

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
# torch.optim.Muon's own Newton-Schulz and lr scaling: on CUDA GatheredMuon takes exactly its steps.
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

from specdistill.drafters.base import Drafter
from specdistill.trainer.config import TrainerConfig


MUON_SCOPES = ("hidden", "all")


def lr_factor(step: int, cfg: TrainerConfig) -> float:
    """Linear warm-up to 1, then linear decay to final_lr_fraction at max_steps."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    span = max(1, cfg.max_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return 1.0 - (1.0 - cfg.final_lr_fraction) * progress


def newton_schulz_fp32(update: torch.Tensor, ns_coefficients, ns_steps: int, eps: float) -> torch.Tensor:
    """torch.optim.Muon's quintic Newton-Schulz orthogonalisation, the same iteration in fp32 instead of bf16.

    For CPUs: torch's bf16 addmm has no fast kernel on CPUs without native bf16 (AVX2: 1.66 s for one 256 x 1280
    matrix, against 0.065 s in fp32), which made the optimizer step of a 2-layer DFlash head 5.2 s, twice its
    forward + backward (docs/quality.md, "Step cost on CPU"). fp32 is also the more precise of the two."""
    a, b, c = ns_coefficients
    x = update.float()
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)  # spectral norm <= 1
    for _ in range(ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def orthogonalise(update: torch.Tensor, ns_coefficients, ns_steps: int, eps: float) -> torch.Tensor:
    """Muon's orthogonalised update: torch's bf16 iteration on CUDA, the fp32 one elsewhere (newton_schulz_fp32)."""
    if update.device.type == "cuda":
        return _zeropower_via_newtonschulz(update, ns_coefficients, ns_steps, eps)
    return newton_schulz_fp32(update, ns_coefficients, ns_steps, eps)


class GatheredMuon(torch.optim.Muon):
    """torch.optim.Muon that also takes sharded (FSDP2 DTensor) matrices: the momentum stays sharded, the
    Newton-Schulz orthogonalisation runs on the all-gathered update (it is a function of the whole matrix), and
    each rank keeps its own rows of the result.

    Plain torch.optim.Muon accepts DTensors too, but its orthogonalisation then runs through sharded matmuls:
    on 2 gloo ranks, 3 steps left 41 of 42 entries of a weight off the unsharded run, by up to 5.6%
    (tests/trainer/test_parallel.py with it swapped in); the gathered one matches to 1e-5.
    Every rank computes the full orthogonalisation (as distributed-Muon designs do for the data-parallel
    group); the gather moves the same bytes as FSDP's own weight all-gather.

    Off CUDA the orthogonalisation runs in fp32 (`orthogonalise`): same iteration, 25x faster on CPUs without
    native bf16; on CUDA every step is torch.optim.Muon's, bit for bit."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads, bufs = [], [], []
            self._init_group(group, params, grads, bufs)
            lr, momentum, decay = group["lr"], group["momentum"], group["weight_decay"]
            for param, grad, buf in zip(params, grads, bufs):
                buf.lerp_(grad, 1 - momentum)
                update = grad.lerp(buf, momentum) if group["nesterov"] else buf
                sharded = isinstance(update, DTensor)
                ortho = orthogonalise(update.full_tensor() if sharded else update,
                                      group["ns_coefficients"], group["ns_steps"], group["eps"])
                if sharded:  # Replicate -> the param's placements is a local slice: no communication
                    mesh = update.device_mesh
                    ortho = DTensor.from_local(ortho, mesh, [Replicate()] * mesh.ndim,
                                               run_check=False).redistribute(mesh, update.placements)
                param.mul_(1 - lr * decay)
                param.add_(ortho.to(param.dtype), alpha=-_adjust_lr(lr, group["adjust_lr_fn"], param.shape))
        return loss


class Optimizers:
    """The two optimizers stepped, zeroed and scheduled as one (specdistill/trainer/parallel.py checkpoints them)."""

    def __init__(self, model: nn.Module, cfg: TrainerConfig):
        params = [p for p in model.parameters() if p.requires_grad]
        if cfg.muon_scope not in MUON_SCOPES:
            raise ValueError(f"trainer.muon_scope={cfg.muon_scope!r} is not one of {MUON_SCOPES}")
        hidden_only = cfg.muon_scope == "hidden" and isinstance(model, Drafter)  # a plain module: every matrix
        not_hidden = {id(p) for p in model.adamw_matrices()} if hidden_only else set()
        matrices = [p for p in params if p.ndim == 2 and id(p) not in not_hidden]
        others = [p for p in params if p.ndim != 2 or id(p) in not_hidden]
        self.cfg = cfg
        self.optimizers: list[torch.optim.Optimizer] = []
        if matrices:
            self.optimizers.append(GatheredMuon(matrices, lr=cfg.muon_lr, weight_decay=cfg.weight_decay,
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

    def clip_step_and_zero(self, parameters, grad_clip: float, agree=None) -> bool:
        """The end of every optimizer step (the trainer's and bench/cached_curve.py's): clip the gradients' global
        norm to trainer.grad_clip, step both optimizers, zero the gradients. Gradients whose norm is not finite
        (clipping would spread the inf/nan into every weight) are dropped without a step: returns False.
        `agree(finite) -> bool`: how the ranks agree on that (trainer: all of them finite)."""
        norm = torch.nn.utils.clip_grad_norm_(parameters, grad_clip)
        finite = bool(torch.isfinite(norm))
        if agree is not None:
            finite = agree(finite)
        if finite:
            self.step()
        self.zero_grad()
        return finite
