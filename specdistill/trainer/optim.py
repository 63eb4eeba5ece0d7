"""Muon for hidden-layer weight matrices, AdamW for everything else (vectors, and the token tables, vocabulary heads
and dynamic gates a drafter declares in adamw_matrices), one linear warm-up/decay schedule."""

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
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


def newton_schulz_flops(shape, ns_steps: int) -> float:
    """FLOPs of one matrix's orthogonalisation: per iteration X X^T (2 m^2 n), A A (2 m^3) and B X (2 m^2 n), for
    sides m <= n (the iteration runs on the wide orientation)."""
    m, n = sorted(shape)
    return ns_steps * (4.0 * m * m * n + 2.0 * m**3)


def assign_owners(costs: list[float], ranks: int) -> list[int]:
    """The rank that orthogonalises each matrix: the costliest first, each to the least-loaded rank (greedy
    longest-processing-time: the busiest rank gets at most 4/3 of the best possible split). Ties go to the earlier
    matrix and the lower rank, so every rank derives the same assignment from the same shapes."""
    loads, owners = [0.0] * ranks, [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        owner = min(range(ranks), key=lambda r: (loads[r], r))
        owners[i] = owner
        loads[owner] += costs[i]
    return owners


def shard_rows(rows: int, ranks: int) -> list[int]:
    """Rows of each rank's shard of a matrix under FSDP2's Shard(0): torch.chunk's split, ceil(rows / ranks) each,
    the last ones shorter or empty."""
    size = -(-rows // ranks)
    return [max(0, min(size, rows - r * size)) for r in range(ranks)]


def exchange_dtype(device: torch.device) -> torch.dtype:
    """The dtype `orthogonalise` works in on this device, so the dtype the split Muon sends updates and results in:
    torch's iteration casts its input to bf16 before anything else and returns bf16 (CUDA), ours casts to fp32.
    Sent in it, an update is bit for bit what the owner orthogonalises, at half the bytes on CUDA."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


_MIXED = ("GatheredMuon: a parameter group mixes sharded (DTensor) and plain matrices; it splits either DDP's "
          "replicated matrices or FSDP2's sharded ones")


def _flat(pieces: list[torch.Tensor], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.cat([p.flatten() for p in pieces]) if pieces else torch.empty(0, dtype=dtype, device=device)


def _update(group: dict, grad: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
    """The momentum-smoothed update torch.optim.Muon orthogonalises (`buf` already holds this step's momentum)."""
    return grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf


def _ortho(group: dict, update: torch.Tensor) -> torch.Tensor:
    return orthogonalise(update, group["ns_coefficients"], group["ns_steps"], group["eps"])


def _apply(group: dict, param: torch.Tensor, ortho: torch.Tensor) -> None:
    """torch.optim.Muon's decoupled weight decay and its lr-scaled step along the orthogonalised update."""
    lr = group["lr"]
    param.mul_(1 - lr * group["weight_decay"])
    param.add_(ortho.to(param.dtype), alpha=-_adjust_lr(lr, group["adjust_lr_fn"], param.shape))


def _orthogonalised_whole(group: dict, update: torch.Tensor) -> torch.Tensor:
    """The unsplit orthogonalisation: a sharded update is gathered whole on this rank, and this rank keeps its own
    rows of the result (Replicate -> the update's placements is a local slice: no communication)."""
    if not isinstance(update, DTensor):
        return _ortho(group, update)
    mesh = update.device_mesh
    ortho = _ortho(group, update.full_tensor())
    return DTensor.from_local(ortho, mesh, [Replicate()] * mesh.ndim,
                              run_check=False).redistribute(mesh, update.placements)


class GatheredMuon(torch.optim.Muon):
    """torch.optim.Muon that also takes sharded (FSDP2 DTensor) matrices and, given the ranks' process group, splits
    its Newton-Schulz orthogonalisation over them. Either way every matrix's step equals torch.optim.Muon's on
    the whole matrix.

    Unsplit (`process_group=None`: one process, or a reference): every rank orthogonalises every matrix; a sharded
    update is all-gathered first (the iteration is a function of the whole matrix) and each rank keeps its own rows.
    Plain torch.optim.Muon accepts DTensors too, but orthogonalises through sharded matmuls: on 2 gloo ranks, 3
    steps left 41 of 42 entries of a weight off the unsharded run, by up to 5.6% (tests/trainer/test_parallel.py
    with it swapped in); the gathered one matches to 1e-5.

    Split (the trainer passes all ranks): each matrix has one owner rank (`assign_owners`, balanced by
    `newton_schulz_flops`), the only rank that orthogonalises it, so a rank does ~1/R of the iterations.
    - DDP (replicated matrices): every rank keeps every momentum buffer (a checkpoint saves rank 0's); an owner
      orthogonalises its matrices' updates and broadcasts its results in one flat buffer. Bytes per rank and step:
      the others' results, ~(R-1)/R of the Muon matrices in `exchange_dtype` (bf16 on CUDA); unsplit moved none.
    - FSDP2 (Shard(0) matrices, momentum sharded): one all-to-all sends each rank's shard of every update to the
      matrix's owner, which orthogonalises the assembled matrix; a second sends each rank its rows of the result.
      Bytes per rank and step: ~2 (R-1)/R^2 of the matrices in `exchange_dtype`, against (R-1)/R in fp32 for the
      unsplit gather of every update on every rank: fewer bytes as well as fewer FLOPs.

    Off CUDA the orthogonalisation runs in fp32 (`orthogonalise`): same iteration, 25x faster on CPUs without
    native bf16; on CUDA every step is torch.optim.Muon's, bit for bit."""

    def __init__(self, params, process_group: dist.ProcessGroup | None = None, **kwargs):
        super().__init__(params, **kwargs)
        split = process_group is not None and dist.get_world_size(process_group) > 1
        self.process_group = process_group if split else None

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads, bufs = [], [], []
            self._init_group(group, params, grads, bufs)
            for grad, buf in zip(grads, bufs):
                buf.lerp_(grad, 1 - group["momentum"])
            if self.process_group is None:
                for param, grad, buf in zip(params, grads, bufs):
                    _apply(group, param, _orthogonalised_whole(group, _update(group, grad, buf)))
            elif not params:
                continue
            elif isinstance(params[0], DTensor):
                self._split_sharded(group, params, [_update(group, g, b) for g, b in zip(grads, bufs)])
            else:
                self._split_replicated(group, params, grads, bufs)
        return loss

    def _owners(self, group: dict, params: list[torch.Tensor]) -> list[int]:
        costs = [newton_schulz_flops(p.shape, group["ns_steps"]) for p in params]
        return assign_owners(costs, dist.get_world_size(self.process_group))

    def _split_replicated(self, group, params, grads, bufs) -> None:
        """DDP: each owner broadcasts its matrices' orthogonalised updates; every rank applies every one."""
        pg, rank = self.process_group, dist.get_rank(self.process_group)
        if any(isinstance(p, DTensor) for p in params):
            raise ValueError(_MIXED)
        owners = self._owners(group, params)
        device, dtype = params[0].device, exchange_dtype(params[0].device)
        # Every rank orthogonalises its own share before the first broadcast, so the shares run at once.
        mine = _flat([_ortho(group, _update(group, grads[i], bufs[i])) for i, o in enumerate(owners) if o == rank],
                     dtype, device)
        for owner in range(dist.get_world_size(pg)):
            owned = [i for i, o in enumerate(owners) if o == owner]
            if not owned:
                continue
            sizes = [params[i].numel() for i in owned]
            flat = mine if owner == rank else torch.empty(sum(sizes), dtype=dtype, device=device)
            dist.broadcast(flat, group=pg, group_src=owner)
            for i, ortho in zip(owned, flat.split(sizes)):
                _apply(group, params[i], ortho.view(params[i].shape))

    def _split_sharded(self, group, params, updates) -> None:
        """FSDP2: one all-to-all sends each rank's rows of every update to the matrix's owner, the owner
        orthogonalises the assembled matrix, a second all-to-all sends each rank its rows of the result."""
        pg = self.process_group
        rank, ranks = dist.get_rank(pg), dist.get_world_size(pg)
        rows = [_check_row_sharded(u, pg, i) for i, u in enumerate(updates)]
        cols = [u.shape[1] for u in updates]
        owners = self._owners(group, params)
        by_owner = [[i for i, o in enumerate(owners) if o == r] for r in range(ranks)]
        mine = by_owner[rank]
        device, dtype = params[0].device, exchange_dtype(params[0].device)
        sent = [sum(rows[i][rank] * cols[i] for i in by_owner[r]) for r in range(ranks)]  # my rows, to each owner
        got = [sum(rows[i][r] * cols[i] for i in mine) for r in range(ranks)]  # each rank's rows of my matrices
        shards = _flat([updates[i].to_local().to(dtype) for r in range(ranks) for i in by_owner[r]], dtype, device)
        received = _all_to_all(shards, sent, got, pg)
        from_rank = [seg.split([rows[i][r] * cols[i] for i in mine]) for r, seg in enumerate(received.split(got))]
        orthos = [_ortho(group, torch.cat([from_rank[r][k].view(rows[i][r], cols[i]) for r in range(ranks)]))
                  for k, i in enumerate(mine)]
        results = _flat([o.split(rows[i])[r] for r in range(ranks) for o, i in zip(orthos, mine)], dtype, device)
        returned = _all_to_all(results, got, sent, pg)
        for r, seg in enumerate(returned.split(sent)):
            for i, local in zip(by_owner[r], seg.split([rows[i][rank] * cols[i] for i in by_owner[r]])):
                _apply(group, params[i], _as_shard(local.view(rows[i][rank], cols[i]), params[i]))


def _all_to_all(send: torch.Tensor, send_sizes: list[int], receive_sizes: list[int], group) -> torch.Tensor:
    received = send.new_empty(sum(receive_sizes))
    dist.all_to_all_single(received, send, receive_sizes, send_sizes, group=group)
    return received


def _as_shard(local: torch.Tensor, like: DTensor) -> DTensor:
    """This rank's rows as a DTensor sharded as `like` (its global shape given: FSDP2's shards can be uneven)."""
    return DTensor.from_local(local, like.device_mesh, like.placements, run_check=False, shape=like.shape,
                              stride=like.stride())


def _check_row_sharded(update: torch.Tensor, group: dist.ProcessGroup, index: int) -> list[int]:
    """Each rank's rows of a sharded update, after checking that it is sharded as FSDP2 shards it: by rows, one
    shard per rank of `group`."""
    ranks = dist.get_world_size(group)
    if not isinstance(update, DTensor):
        raise ValueError(_MIXED)
    mesh = update.device_mesh
    same_ranks = mesh.ndim == 1 and (dist.get_process_group_ranks(mesh.get_group())
                                     == dist.get_process_group_ranks(group))
    if not same_ranks or tuple(update.placements) != (Shard(0),):
        raise ValueError(f"GatheredMuon: matrix {index} ({tuple(update.shape)}) is sharded {update.placements} over a "
                         f"mesh of shape {tuple(mesh.shape)}; the split Newton-Schulz takes FSDP2's Shard(0) over "
                         f"the {ranks} ranks of its process group")
    rows = shard_rows(update.shape[0], ranks)
    local = update.to_local().shape[0]
    if local != rows[dist.get_rank(group)]:
        raise ValueError(f"GatheredMuon: matrix {index} ({tuple(update.shape)}) holds {local} rows on this rank; "
                         f"FSDP2's Shard(0) over {ranks} ranks gives {rows}")
    return rows


class Optimizers:
    """The two optimizers stepped, zeroed and scheduled as one (specdistill/trainer/parallel.py checkpoints them)."""

    def __init__(self, model: nn.Module, cfg: TrainerConfig, process_group: dist.ProcessGroup | None = None):
        """`process_group`: the ranks Muon splits its Newton-Schulz over (GatheredMuon); None: not split."""
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
            self.optimizers.append(GatheredMuon(matrices, process_group, lr=cfg.muon_lr,
                                                weight_decay=cfg.weight_decay, adjust_lr_fn="match_rms_adamw"))
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
