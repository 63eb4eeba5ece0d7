"""Loss and gradient parity with speculators 0.9.0's own classes: the same weights (loaded from our export, so
parameter names agree, bench/speculators_reference.py) and batch must give the same loss and the same gradient on
every trained parameter."""

import torch

RTOL = 1e-5  # fp32, relative


def assert_same_loss_and_gradients(ours: torch.nn.Module, our_loss: torch.Tensor, ref: torch.nn.Module,
                                   ref_loss: torch.Tensor, min_params: int) -> None:
    """Backpropagates both losses; every parameter of ours that gets a gradient must have the reference's
    (relative Frobenius error <= RTOL), and at least min_params of them are compared."""
    torch.testing.assert_close(our_loss.detach(), ref_loss.detach(), rtol=RTOL, atol=0)
    our_loss.backward()
    ref_loss.backward()
    ref_params = dict(ref.named_parameters())
    compared = []
    for name, p in ours.named_parameters():
        if p.grad is None:
            continue
        assert name in ref_params, f"{name}: no such parameter in {type(ref).__name__}"
        g = ref_params[name].grad
        assert g is not None, f"{name}: trained here, no gradient in {type(ref).__name__}"
        rel = relative_error(p.grad, g)
        assert rel <= RTOL, f"{name}: gradient differs by {rel:.2e} (relative)"
        compared.append(name)
    assert len(compared) >= min_params, compared


def relative_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    """|x - ref| / |ref| (Frobenius): what RTOL bounds for a whole gradient, whose near-zero entries carry only the
    summation order's absolute error."""
    return float((x - ref).norm() / ref.norm().clamp(min=1e-30))


def block_reference_inputs(batch, drafter, info) -> tuple:
    """speculators' DFlash-family forward arguments for a pack (no shift: blocks start at the anchor itself)."""
    return (batch.layers(drafter.target_layer_ids).flatten(1)[None], batch.input_ids_T[None],
            batch.loss_mask_T[None].long(), batch.layers([info.num_hidden_layers])[:, 0][None],
            batch.document_ids_T[None], batch.position_ids_T[None])
