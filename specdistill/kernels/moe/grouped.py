"""Grouped-GEMM experts: one custom autograd Function for permute -> gate_up -> SwiGLU -> down -> combine.

Measured on 2 CPU cores (bf16, 64 experts x ~512 rows, D=512, I=512), one projection: grouped_mm 0.82 s,
one padded torch.bmm over [E, C, D] 0.43 s (torch's CPU grouped_mm is a loop of per-expert mm). So:
- layout "padded": rows of each expert padded to capacity C = max tokens per expert, GEMMs as bmm. Pad rows
  are zero, so they add exactly 0 to every weight gradient. Used on CPU when padding costs <= PAD_LIMIT x.
- layout "grouped": rows sorted by expert, GEMMs as torch.nn.functional.grouped_mm (CUDA, or skewed routing).
Both gather tokens into rows once and un-permute by gathering rows back ([T, K] row index), so the backward
of the permutation is a gather + sum over K, never an atomic scatter-add. Only the gate_up output h and the
down output y are saved; x's rows and silu(gate)*up are recomputed in backward.

FP8 storage: expert weights held as float8_e4m3fn with a per-(expert, output row) scale are upcast per group of
experts just before their GEMM ("padded" layout), so at most one group's bf16 copy is alive. FP8-stored experts
are frozen: gradients flow to x and to the routing weights only.

Suffixes: T tokens, K top-k, S = T*K routed pairs, R buffer rows, E experts, D hidden, I intermediate.
"""

import torch
import torch.nn.functional as F

PAD_LIMIT = 1.5  # use the padded layout while E * C <= PAD_LIMIT * S
FP8_GROUP = 8  # experts upcast together


def plan_rows(index_TK: torch.Tensor, num_experts: int, layout: str):
    """Row of each routed pair in the expert buffer [T, K], tokens per expert [E], capacity (padded) or offsets."""
    flat_S = index_TK.flatten()
    order_S = torch.argsort(flat_S, stable=True)
    counts_E = torch.bincount(flat_S, minlength=num_experts)
    starts_E = torch.cumsum(counts_E, 0) - counts_E
    rank_S = torch.arange(flat_S.numel(), device=flat_S.device) - starts_E[flat_S[order_S]]
    if layout == "auto":
        capacity = int(counts_E.max())
        fits = num_experts * capacity <= PAD_LIMIT * flat_S.numel()
        layout = "padded" if index_TK.device.type == "cpu" and fits else "grouped"
    rows_S = torch.empty_like(flat_S)
    if layout == "padded":
        capacity = int(counts_E.max())
        rows_S[order_S] = flat_S[order_S] * capacity + rank_S
        return rows_S.view(index_TK.shape), layout, capacity, counts_E
    rows_S[order_S] = torch.arange(flat_S.numel(), device=flat_S.device)
    return rows_S.view(index_TK.shape), layout, torch.cumsum(counts_E, 0).to(torch.int32), counts_E


class _Gemm:
    """x [R, in] @ w[e]^T per expert group, w [E, out, in], for either layout; w may be fp8 + scale."""

    def __init__(self, layout, meta, num_experts):
        self.layout, self.meta, self.E = layout, meta, num_experts

    def fwd(self, x_R, w, scale=None):  # -> [R, out]
        if self.layout == "grouped":
            return F.grouped_mm(x_R, _dequant(w, scale, x_R.dtype).transpose(1, 2), offs=self.meta)
        xb = x_R.view(self.E, self.meta, -1)
        if scale is None:
            return torch.bmm(xb, w.transpose(1, 2)).view(x_R.shape[0], -1)
        outs = [torch.bmm(xb[e:e + FP8_GROUP], _dequant(w[e:e + FP8_GROUP], scale[e:e + FP8_GROUP], x_R.dtype)
                          .transpose(1, 2)) for e in range(0, self.E, FP8_GROUP)]
        return torch.cat(outs).view(x_R.shape[0], -1)

    def dx(self, g_R, w, scale=None):  # g [R, out] -> [R, in]
        if self.layout == "grouped":
            return F.grouped_mm(g_R, _dequant(w, scale, g_R.dtype), offs=self.meta)
        gb = g_R.view(self.E, self.meta, -1)
        if scale is None:
            return torch.bmm(gb, w).view(g_R.shape[0], -1)
        outs = [torch.bmm(gb[e:e + FP8_GROUP], _dequant(w[e:e + FP8_GROUP], scale[e:e + FP8_GROUP], g_R.dtype))
                for e in range(0, self.E, FP8_GROUP)]
        return torch.cat(outs).view(g_R.shape[0], -1)

    def dw(self, g_R, x_R):  # -> [E, out, in]
        if self.layout == "grouped":
            return F.grouped_mm(g_R.t(), x_R, offs=self.meta)
        return torch.bmm(g_R.view(self.E, self.meta, -1).transpose(1, 2), x_R.view(self.E, self.meta, -1))


def _dequant(w, scale, dtype):
    return w if scale is None else w.to(dtype) * scale.to(dtype)[..., None]


def _silu_mul_grad(h_R2I, da_RI):
    gate, up = h_R2I.chunk(2, dim=-1)
    s = torch.sigmoid(gate)
    return torch.cat([da_RI * up * s * (1 + gate * (1 - s)), da_RI * gate * s], dim=-1)


class _GroupedExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, weights_TK, gate_up, down, gate_up_scale, down_scale, rows_TK, num_rows, gemm):
        T, K = rows_TK.shape
        x_R = x_TD.new_zeros(num_rows, x_TD.shape[1])
        x_R[rows_TK.flatten()] = x_TD.repeat_interleave(K, dim=0)
        h_R = gemm.fwd(x_R, gate_up, gate_up_scale)
        gate, up = h_R.chunk(2, dim=-1)
        y_R = gemm.fwd(F.silu(gate) * up, down, down_scale)
        ctx.save_for_backward(x_TD, weights_TK, gate_up, down, gate_up_scale, down_scale, rows_TK, h_R, y_R)
        ctx.gemm = gemm
        return torch.einsum("tk,tkd->td", weights_TK, y_R[rows_TK])

    @staticmethod
    def backward(ctx, g_TD):
        x_TD, weights_TK, gate_up, down, gate_up_scale, down_scale, rows_TK, h_R, y_R = ctx.saved_tensors
        gemm, (T, K), rows_S = ctx.gemm, rows_TK.shape, rows_TK.flatten()
        g_TD = g_TD.contiguous()
        d_weights = torch.einsum("td,tkd->tk", g_TD.float(), y_R[rows_TK].float()).to(weights_TK.dtype)
        dy_R = torch.zeros_like(y_R)
        dy_R[rows_S] = (g_TD[:, None, :] * weights_TK[..., None]).reshape(T * K, -1)
        gate, up = h_R.chunk(2, dim=-1)
        a_R = F.silu(gate) * up
        dh_R = _silu_mul_grad(h_R, gemm.dx(dy_R, down, down_scale))
        dx_TD = gemm.dx(dh_R, gate_up, gate_up_scale)[rows_TK].sum(1)
        d_down = d_gate_up = None
        if ctx.needs_input_grad[2] or ctx.needs_input_grad[3]:
            x_R = x_TD.new_zeros(dh_R.shape[0], x_TD.shape[1])  # [R, D]: D may exceed 2 x intermediate
            x_R[rows_S] = x_TD.repeat_interleave(K, dim=0)
            d_gate_up = gemm.dw(dh_R, x_R) if ctx.needs_input_grad[2] else None
            d_down = gemm.dw(dy_R, a_R) if ctx.needs_input_grad[3] else None
        return dx_TD, d_weights, d_gate_up, d_down, None, None, None, None, None


def grouped_experts(x_TD, index_TK, weights_TK, gate_up_proj, down_proj, gate_up_scale=None, down_scale=None,
                    layout: str = "auto") -> torch.Tensor:
    """Routed experts output [T, D]; equal to `reference.experts_loop`. layout: auto | padded | grouped."""
    if layout not in ("auto", "padded", "grouped"):
        raise ValueError(f"MoE layout {layout!r} is not one of ('auto', 'padded', 'grouped')")
    if (gate_up_scale is None) != (gate_up_proj.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2)):
        raise ValueError("fp8 expert weights need their per-row scales (gate_up_scale, down_scale), "
                         "and scales are only for fp8 weights")
    E = gate_up_proj.shape[0]
    rows_TK, layout, meta, _ = plan_rows(index_TK, E, layout)
    num_rows = E * meta if layout == "padded" else index_TK.numel()
    return _GroupedExperts.apply(x_TD, weights_TK, gate_up_proj, down_proj, gate_up_scale, down_scale,
                                 rows_TK, num_rows, _Gemm(layout, meta, E))


def quantize_fp8(w_EOI: torch.Tensor, dtype=torch.float8_e4m3fn):
    """Per-(expert, output row) absmax scaling to fp8: (w_fp8, scale_EO), w ~= w_fp8 * scale."""
    scale = w_EOI.float().abs().amax(dim=-1).clamp(min=1e-12) / torch.finfo(dtype).max
    return (w_EOI.float() / scale[..., None]).to(dtype), scale
