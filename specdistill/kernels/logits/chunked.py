"""Response-only losses in chunks: logits exist for `chunk` positions at a time, in forward and backward.

The caller gathers the M loss positions first (hidden_MD = hidden_TD[loss positions]), so no [T, V] tensor is
ever built; this module also never holds [M, V]. Two ways to get the gradient, equal up to float rounding:
- the head's weight is frozen (the target's lm_head: DFlash, DFlash 2, MTP, EAGLE-3 without train_lm_head): the
  forward turns each chunk's logits into dloss_m/dh_m right away and keeps only those [M, D]; backward scales row m
  by the caller's dL/dloss_m. The logits are formed once, not again in backward (a third fewer vocabulary matmuls);
- the weight is trained (DSpark's concatenated head): dL/dW = sum_m g_m dz_m^T h_m needs the caller's g_m inside
  the sum, so forward keeps only the per-position losses and backward recomputes each chunk's logits (draft and
  target) and turns them into dL/dh and dL/dW.
Per-position losses are returned ([M], reduction left to the caller, e.g. D-PACE weights).

Gradients w.r.t. the draft logits z (q = softmax z, p = target distribution, y = label):
  CE  = lse(z) - z_y                     -> q - onehot(y)
  KL  = sum p (log p - log q)            -> q - p
  TV  = 0.5 sum |p - q|, s = sign(q - p) -> 0.5 q (s - <s, q>)
Logits are computed in the weights' dtype and upcast to fp32, as the reference does.
Suffixes: M loss positions, C chunk rows, D hidden, V vocab.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

DEFAULT_CHUNK = 1024


def _loss_and_grad(kind, z_CV, target_CV, labels_C, ignore_index, need_grad):
    """Per-row loss [C] and, when needed, dloss/dz [C, V] (fp32)."""
    logq = torch.log_softmax(z_CV, -1)
    if kind == "ce":
        valid = labels_C != ignore_index
        safe = torch.where(valid, labels_C, 0)
        loss = -logq.gather(1, safe[:, None])[:, 0] * valid
        if not need_grad:
            return loss, None
        grad = logq.exp_()
        grad[torch.arange(grad.shape[0], device=grad.device), safe] -= 1
        return loss, grad * valid[:, None]
    logp = torch.log_softmax(target_CV, -1)
    p = logp.exp()
    q = logq.exp()
    if kind == "kl":
        loss = (p * (logp - logq)).sum(-1)
        return loss, (q - p if need_grad else None)
    diff = q - p
    loss = 0.5 * diff.abs().sum(-1)
    if not need_grad:
        return loss, None
    s = torch.sign(diff)
    return loss, 0.5 * q * (s - (s * q).sum(-1, keepdim=True))


class _ChunkedLoss(torch.autograd.Function):
    """Outputs: per-row loss [M] (differentiable) and, from the same chunks of logits (no extra matmul), the
    draft's greedy token [M], the target's greedy token [M] and TV(p_target, q) [M] (empty when no target)."""

    @staticmethod
    def forward(ctx, hidden_MD, weight_VD, target_hidden_MD, target_weight_VD, target_logits_UV, target_rows_M, labels_M,
                kind, chunk, ignore_index, want_tv, grad_in_forward):
        losses, draft_tok, target_tok, tv = [], [], [], []
        # grad_in_forward: dloss_m/dh_m per row, formed from this pass's logits (the weight is frozen)
        d_hidden = torch.empty_like(hidden_MD) if grad_in_forward else None
        for c0 in range(0, hidden_MD.shape[0], chunk):
            z, t = _chunk_logits(hidden_MD, weight_VD, target_hidden_MD, target_weight_VD, target_logits_UV,
                                 target_rows_M, c0, chunk)
            lab = labels_M[c0:c0 + chunk] if labels_M is not None else None
            draft_tok.append(z.argmax(-1))
            if t is not None:
                target_tok.append(t.argmax(-1))
            if want_tv:
                tv.append(0.5 * (torch.softmax(t, -1) - torch.softmax(z, -1)).abs().sum(-1))
            loss, dz = _loss_and_grad(kind, z, t, lab, ignore_index, need_grad=grad_in_forward)
            losses.append(loss)
            if grad_in_forward:
                d_hidden[c0:c0 + chunk] = dz.to(weight_VD.dtype) @ weight_VD
        if grad_in_forward:
            ctx.save_for_backward(d_hidden)
        else:
            ctx.save_for_backward(hidden_MD, weight_VD, target_hidden_MD, target_weight_VD, target_logits_UV,
                                  target_rows_M, labels_M)
        ctx.kind, ctx.chunk, ctx.ignore_index, ctx.grad_in_forward = kind, chunk, ignore_index, grad_in_forward
        # Unless grad_in_forward, the backward recomputes the logits: under the same autocast as the forward (a bf16
        # activation times an fp32 master weight only multiplies under autocast; torch.amp.custom_bwd does this for
        # one device type).
        ctx.device_type = hidden_MD.device.type
        ctx.autocast = torch.is_autocast_enabled(ctx.device_type)
        ctx.autocast_dtype = torch.get_autocast_dtype(ctx.device_type)
        empty_f, empty_l = hidden_MD.new_zeros(0, dtype=torch.float32), hidden_MD.new_zeros(0, dtype=torch.long)
        outs = (torch.cat(losses) if losses else empty_f, torch.cat(draft_tok) if draft_tok else empty_l,
                torch.cat(target_tok) if target_tok else empty_l, torch.cat(tv) if tv else empty_f)
        ctx.mark_non_differentiable(*outs[1:])
        return outs

    @staticmethod
    def backward(ctx, g_M, *_no_grad):
        if ctx.grad_in_forward:
            (d_hidden,) = ctx.saved_tensors
            return (d_hidden * g_M[:, None].to(d_hidden.dtype),) + (None,) * 11
        with torch.autocast(ctx.device_type, dtype=ctx.autocast_dtype, enabled=ctx.autocast):
            return _ChunkedLoss._backward(ctx, g_M)

    @staticmethod
    def _backward(ctx, g_M):
        hidden_MD, weight_VD, target_hidden_MD, target_weight_VD, target_logits_UV, target_rows_M, labels_M = \
            ctx.saved_tensors
        chunk = ctx.chunk
        d_hidden = torch.empty_like(hidden_MD) if ctx.needs_input_grad[0] else None
        d_weight = torch.zeros_like(weight_VD, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        for c0 in range(0, hidden_MD.shape[0], chunk):
            z, t = _chunk_logits(hidden_MD, weight_VD, target_hidden_MD, target_weight_VD, target_logits_UV,
                                 target_rows_M, c0, chunk)
            lab = labels_M[c0:c0 + chunk] if labels_M is not None else None
            _, dz = _loss_and_grad(ctx.kind, z, t, lab, ctx.ignore_index, need_grad=True)
            dz = (dz * g_M[c0:c0 + chunk, None]).to(weight_VD.dtype)
            if d_hidden is not None:
                d_hidden[c0:c0 + chunk] = dz @ weight_VD
            if d_weight is not None:
                d_weight.add_(dz.t() @ hidden_MD[c0:c0 + chunk].to(dz.dtype))  # accumulated over chunks in fp32
        d_weight = d_weight.to(weight_VD.dtype) if d_weight is not None else None
        return d_hidden, d_weight, None, None, None, None, None, None, None, None, None, None


def _chunk_logits(hidden_MD, weight_VD, target_hidden_MD, target_weight_VD, target_logits_UV, target_rows_M, c0,
                  chunk):
    z = F.linear(hidden_MD[c0:c0 + chunk], weight_VD).float()
    if target_logits_UV is not None:  # rows of the caller's logits: gathered a chunk at a time, never all M
        return z, target_logits_UV[target_rows_M[c0:c0 + chunk]].float()
    if target_hidden_MD is None:
        return z, None
    with torch.no_grad():
        t = F.linear(target_hidden_MD[c0:c0 + chunk], target_weight_VD).float()
    return z, t


@dataclass
class LossRows:
    """Per-row results of one chunked pass: the loss (differentiable) and what the same logits give for free."""

    loss: torch.Tensor  # [M] fp32
    draft_token: torch.Tensor  # [M] the draft's greedy token (metrics, no extra lm_head pass)
    target_token: torch.Tensor | None  # [M] the target's greedy token (KL/TV only)
    tv: torch.Tensor | None  # [M] TV(p_target, q) with q detached: 1 - tv is the lossless acceptance rate


def chunked_loss(kind: str, hidden_MD, weight_VD, target_hidden_MD=None, target_weight_VD=None, labels_M=None,
                 chunk: int = DEFAULT_CHUNK, ignore_index: int = -100, with_tv: bool = False,
                 target_logits_UV=None, target_rows_M=None, grad_in_forward: bool | None = None) -> LossRows:
    """One chunked pass: per-row `kind` loss ("ce" to labels_M; "kl" / "tv" to the target's distribution) and,
    from the same logits, the greedy tokens a training step reports as metrics (and TV with with_tv=True).

    target_logits_UV, target_rows_M: the target's logits over weight_VD's vocabulary, computed by the caller for U
    positions, and which of them each of the M rows is; instead of target_hidden_MD / target_weight_VD. For a caller
    that scores the same target positions several times in a step (EAGLE-3's chain steps) and computes them once:
    it holds [U, V] by its own choice, and every call shares it (rows are gathered a chunk at a time).

    grad_in_forward: form dloss/dh in the forward pass instead of recomputing the logits in backward (module
    docstring); None: whenever a gradient is wanted for hidden_MD and none for weight_VD. False is the reference the
    tests compare it with."""
    wanted = torch.is_grad_enabled() and hidden_MD.requires_grad
    if grad_in_forward is None:
        grad_in_forward = wanted and not weight_VD.requires_grad
    elif grad_in_forward and weight_VD.requires_grad:
        raise ValueError("grad_in_forward needs a frozen weight_VD: dL/dW sums the caller's per-row gradients")
    grad_in_forward = grad_in_forward and wanted
    if kind == "ce":
        target_hidden_MD = target_weight_VD = target_logits_UV = target_rows_M = None
    elif target_logits_UV is not None:
        if target_rows_M is None or target_rows_M.shape[0] != hidden_MD.shape[0]:
            raise ValueError(f"target_logits_UV needs target_rows_M, one row index per hidden row ({hidden_MD.shape[0]})")
        target_hidden_MD = target_weight_VD = None
        target_logits_UV = target_logits_UV.detach()
    else:
        target_hidden_MD, target_weight_VD = target_hidden_MD.detach(), target_weight_VD.detach()
    loss, draft, target, tv = _ChunkedLoss.apply(hidden_MD, weight_VD, target_hidden_MD, target_weight_VD,
                                                 target_logits_UV, target_rows_M, labels_M, kind, chunk, ignore_index,
                                                 with_tv and kind != "ce", grad_in_forward)
    with_target = target_hidden_MD is not None or target_logits_UV is not None
    return LossRows(loss, draft, target if with_target else None, tv if with_tv and with_target else None)


def chunked_ce(hidden_MD, weight_VD, labels_M, chunk: int = DEFAULT_CHUNK, ignore_index: int = -100):
    """Per-position CE [M] of softmax(hidden W^T) to hard labels; equals `reference.ce_reference`."""
    return chunked_loss("ce", hidden_MD, weight_VD, labels_M=labels_M, chunk=chunk, ignore_index=ignore_index).loss


def chunked_kl(hidden_MD, weight_VD, target_hidden_MD, target_weight_VD, chunk: int = DEFAULT_CHUNK):
    """Per-position KL(target || draft) [M]; target logits = target_hidden W_t^T, built per chunk, no grad."""
    return chunked_loss("kl", hidden_MD, weight_VD, target_hidden_MD, target_weight_VD, chunk=chunk).loss


def chunked_tv(hidden_MD, weight_VD, target_hidden_MD, target_weight_VD, chunk: int = DEFAULT_CHUNK):
    """Per-position total-variation distance 0.5 |p_target - q| [M]; equals `reference.tv_reference`."""
    return chunked_loss("tv", hidden_MD, weight_VD, target_hidden_MD, target_weight_VD, chunk=chunk).loss


@torch.no_grad()
def chunked_argmax(hidden_MD, weight_VD, chunk: int = DEFAULT_CHUNK) -> torch.Tensor:
    """Greedy token [M] of hidden W^T, a chunk of logits at a time (metrics, the served draft)."""
    out = [F.linear(hidden_MD[c0:c0 + chunk], weight_VD).argmax(-1) for c0 in range(0, hidden_MD.shape[0], chunk)]
    return torch.cat(out) if out else hidden_MD.new_zeros(0, dtype=torch.long)
