"""Chunked response-only losses equal the naive full-logit computation (values and gradients)."""

import pytest
import torch

from specdistill.kernels.logits import ce_reference, chunked_ce, chunked_kl, chunked_tv, kl_reference, tv_reference
from specdistill.kernels.logits import chunked as chunked_module

M, D, V = 45, 24, 203

# fp32: same math, per-chunk summation order (~1e-6). bf16 inputs: both compute logits with bf16 GEMMs upcast
# to fp32; the weight gradient differs because ours accumulates chunks in fp32 and the reference in one bf16 GEMM.
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}

CASES = {
    "ce": (chunked_ce, ce_reference, "labels"),
    "kl": (chunked_kl, kl_reference, "target"),
    "tv": (chunked_tv, tv_reference, "target"),
}


def inputs(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(M, D, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(V, D, generator=g) * 0.3).to(dtype).requires_grad_()
    target = (torch.randn(M, D, generator=g).to(dtype), (torch.randn(V, D, generator=g) * 0.3).to(dtype))
    labels = torch.randint(0, V, (M,), generator=g)
    labels[[0, 7]] = -100  # ignored positions: zero loss, zero gradient
    return hidden, weight, target, labels, torch.rand(M, generator=g)


def rel_err(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-12)).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", sorted(CASES))
@pytest.mark.parametrize("chunk", [4, 1000])  # 4: a ragged last chunk
def test_chunked_equals_naive(kind, dtype, chunk):
    fast, ref, extra = CASES[kind]
    hidden, weight, target, labels, g = inputs(dtype)
    args = (labels,) if extra == "labels" else target
    expected = ref(hidden, weight, *args)
    actual = fast(hidden, weight, *args, chunk=chunk)
    assert actual.shape == (M,) and actual.dtype == torch.float32
    assert rel_err(actual, expected) <= TOL[dtype]
    for name, a, b in zip(("dhidden", "dweight"), torch.autograd.grad(actual, (hidden, weight), g),
                          torch.autograd.grad(expected, (hidden, weight), g)):
        assert a.dtype == b.dtype
        assert rel_err(a, b) <= TOL[dtype], f"{kind} {name} chunk={chunk}"


def test_ignored_labels_have_no_loss_or_gradient():
    hidden, weight, _, labels, _ = inputs(torch.float32)
    loss = chunked_ce(hidden, weight, labels, chunk=4)
    assert loss[0] == 0 and loss[7] == 0
    dh = torch.autograd.grad(loss.sum(), hidden)[0]
    assert dh[0].abs().max() == 0 and dh[1].abs().max() > 0


def test_identical_distributions_give_zero_kl_and_tv():
    hidden, weight, _, _, _ = inputs(torch.float32)
    assert chunked_kl(hidden, weight, hidden, weight).abs().max() < 1e-6
    assert chunked_tv(hidden, weight, hidden, weight).abs().max() < 1e-6


def test_never_builds_more_than_one_chunk_of_logits(monkeypatch):
    """Every logit tensor the chunked path creates has at most `chunk` rows, forward and backward."""
    hidden, weight, target, _, _ = inputs(torch.float32)
    seen = []
    real = chunked_module._chunk_logits

    def spy(*a):
        z, t = real(*a)
        seen.append(z.shape[0])
        return z, t

    monkeypatch.setattr(chunked_module, "_chunk_logits", spy)
    chunked_kl(hidden, weight, *target, chunk=10).sum().backward()
    assert max(seen) == 10 and sum(seen) == 2 * M  # forward once, recomputed once in backward


@pytest.mark.parametrize("kind", ["ce", "kl"])
def test_one_pass_gives_the_metrics_the_step_reports(kind):
    """chunked_loss's greedy tokens and TV come from the loss's own logits: equal to separate passes, with the
    loss and its gradients unchanged."""
    from specdistill.kernels.logits import chunked_argmax, chunked_loss

    hidden, weight, target, labels, g = inputs(torch.float32)
    rows = chunked_loss(kind, hidden, weight, *target, labels_M=labels, chunk=4, with_tv=True)
    assert torch.equal(rows.draft_token, chunked_argmax(hidden, weight))
    if kind == "ce":
        assert rows.target_token is None and rows.tv is None
        expected = ce_reference(hidden, weight, labels)
    else:
        assert torch.equal(rows.target_token, chunked_argmax(*target))
        assert rel_err(rows.tv, tv_reference(hidden, weight, *target)) <= 1e-5
        expected = kl_reference(hidden, weight, *target)
    assert rel_err(rows.loss, expected) <= 1e-5
    for a, b in zip(torch.autograd.grad(rows.loss, (hidden, weight), g), torch.autograd.grad(expected, (hidden, weight), g)):
        assert rel_err(a, b) <= 1e-5


@pytest.mark.parametrize("kind", sorted(CASES))
def test_chunked_loss_trains_under_bf16_autocast_over_fp32_weights(kind):
    """The trainer's precision on GPUs: bf16 activations, fp32 master weights, autocast. The backward recomputes
    the logits and must run under the forward's autocast (it failed with a bf16 x fp32 matmul before), giving the
    fp32 weight an fp32 gradient close to the all-fp32 one."""
    fast, ref, extra = CASES[kind]
    hidden, weight, target, labels, g = inputs(torch.float32)
    args = (labels,) if extra == "labels" else target
    expected = torch.autograd.grad(ref(hidden, weight, *args), (hidden, weight), g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = hidden * 1  # an autocast op's bf16 output, as a drafter's last layer gives
        h = torch.nn.functional.linear(h, torch.eye(D))
        assert h.dtype == torch.bfloat16
        actual = fast(h, weight, *args, chunk=4)
    d_hidden, d_weight = torch.autograd.grad(actual, (hidden, weight), g)
    assert d_weight.dtype == torch.float32 and d_hidden.dtype == torch.float32
    for actual_grad, expected_grad in zip((d_hidden, d_weight), expected):
        if kind == "tv":  # sign(p - q): bf16 rounding flips the sign of near-equal probabilities
            assert torch.cosine_similarity(actual_grad.flatten(), expected_grad.flatten(), dim=0) > 0.9
        else:
            assert rel_err(actual_grad, expected_grad) <= 3e-2


@pytest.mark.parametrize("kind", ["kl", "tv"])
def test_precomputed_target_logits_by_row_index_equal_recomputing_them(kind):
    """target_logits_UV + target_rows_M (a caller's logits for U distinct positions, M rows indexing them) give the
    loss, gradients and metrics of passing each row's target state; a missing or wrong-length index is refused."""
    from specdistill.kernels.logits import chunked_loss

    hidden, weight, (target_U, target_weight), _, g = inputs(torch.float32)
    rows_M = torch.randint(0, M, (M,), generator=torch.Generator().manual_seed(1))  # positions repeat
    logits_UV = target_U @ target_weight.t()
    results = []
    for args in ({"target_hidden_MD": target_U[rows_M], "target_weight_VD": target_weight},
                 {"target_logits_UV": logits_UV, "target_rows_M": rows_M}):
        h, w = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
        out = chunked_loss(kind, h, w, chunk=4, with_tv=True, **args)
        (out.loss * g).sum().backward()
        results.append((out, h.grad, w.grad))
    (a, a_h, a_w), (b, b_h, b_w) = results
    for x, y in ((a.loss, b.loss), (a.tv, b.tv), (a_h, b_h), (a_w, b_w)):
        assert rel_err(y, x) < 1e-5
    assert torch.equal(a.draft_token, b.draft_token) and torch.equal(a.target_token, b.target_token)
    with pytest.raises(ValueError, match="target_rows_M, one row index per hidden row"):
        chunked_loss(kind, hidden, weight, target_logits_UV=logits_UV, target_rows_M=rows_M[:-1])


@pytest.mark.parametrize("kind", sorted(CASES))
@pytest.mark.parametrize("chunk", [4, 1000])
def test_a_frozen_head_forms_its_gradient_in_forward_as_the_recomputing_backward_does(kind, chunk, monkeypatch):
    """A frozen weight (the target's lm_head): the forward forms dloss/dh from its own logits and backward only
    scales it by each row's upstream gradient. Loss and dL/dh equal the recomputing path's (fp32, rtol 1e-5) and
    the reference's, and the logits are built once instead of twice."""
    from specdistill.kernels.logits import chunked_loss

    fast, ref, extra = CASES[kind]
    hidden, weight, target, labels, g = inputs(torch.float32)
    weight = weight.detach()
    seen = []
    real = chunked_module._chunk_logits
    monkeypatch.setattr(chunked_module, "_chunk_logits", lambda *a: seen.append(a[6]) or real(*a))
    results = {}
    for fused in (True, False):
        seen.clear()
        rows = chunked_loss(kind, hidden, weight, *target, labels_M=labels, chunk=chunk, grad_in_forward=fused)
        (d_hidden,) = torch.autograd.grad(rows.loss, hidden, g)
        results[fused] = (rows.loss, d_hidden, len(seen))
    args = (labels,) if extra == "labels" else target
    expected = ref(hidden, weight, *args)
    (expected_dh,) = torch.autograd.grad(expected, hidden, g)
    chunks = -(-M // chunk)
    assert results[True][2] == chunks and results[False][2] == 2 * chunks
    for fused in (True, False):
        assert rel_err(results[fused][0], expected) <= 1e-5 and rel_err(results[fused][1], expected_dh) <= 1e-5
    assert torch.allclose(results[True][0], results[False][0], rtol=1e-5, atol=0)
    assert torch.allclose(results[True][1], results[False][1], rtol=1e-5, atol=1e-7)


def test_a_frozen_head_under_bf16_autocast_and_without_grad():
    """Under bf16 autocast over an fp32 frozen head the in-forward gradient is the recomputing one's (both bf16
    matmuls); under no_grad, or for a trained head, nothing is formed in forward (and asking for it there is an
    error: dL/dW needs the upstream gradient inside its sum)."""
    from specdistill.kernels.logits import chunked_loss

    hidden, weight, target, _, g = inputs(torch.float32)
    grads = []
    for fused in (True, False):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = torch.nn.functional.linear(hidden * 1, torch.eye(D))
            rows = chunked_loss("kl", h, weight.detach(), *target, chunk=4, grad_in_forward=fused)
        grads.append(torch.autograd.grad(rows.loss, hidden, g)[0])
    assert grads[0].dtype == torch.float32 and rel_err(grads[0], grads[1]) <= 2e-2
    with torch.no_grad():
        assert chunked_loss("kl", hidden, weight.detach(), *target, chunk=4).loss.shape == (M,)
    with pytest.raises(ValueError, match="frozen weight_VD"):
        chunked_loss("kl", hidden, weight, *target, grad_in_forward=True)
