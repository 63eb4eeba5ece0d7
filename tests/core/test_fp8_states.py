"""FP8 states (feature_server.hidden_dtype=float8_e4m3fn, core/contract.py): the round trip's error per value, and
packs of fp8 samples (pack(), the feed's PackAssembler) reading as their dequantised samples once on the device."""

import numpy as np
import pytest
import torch

from specdistill.core.batch import PackAssembler, pack
from specdistill.core.contract import FeatureSample, FeatureSpec, TokenizedRow, dequantise, quantise_fp8
from specdistill.core.rows import ListRows
from specdistill.feature_server.backends import sample_layout, sample_tensors
from tests.feature_server.rows import fp8_bound

FP8_SPEC = FeatureSpec((1, 2, 3), "float8_e4m3fn", context_window=4, response_layer_ids=(3,))


def test_each_value_comes_back_within_the_e4m3_bound_of_its_position_and_layer():
    """|x - x'| <= max(2^-4 |x|, 2^-10 s), s = amax / 448 of x's [position, layer] (fp8_bound). Layers of one
    position differ by 10^6 in scale (a scale per position would flush the small one to zero and fail), and values
    within a [position, layer] span 10^8, so some fall below e4m3's normal range."""
    g = torch.Generator().manual_seed(0)
    x_NLD = torch.randn(64, 3, 256, generator=g) * torch.exp(4 * torch.randn(64, 3, 256, generator=g))
    x_NLD[:, 0] *= 1e-3
    x_NLD[:, 2] *= 1e3
    x_NLD[5, 1] = 0  # a [position, layer] of zeros
    values_NLD, scale_NL = quantise_fp8(x_NLD)
    assert values_NLD.dtype == torch.float8_e4m3fn and scale_NL.dtype == torch.float32
    back_NLD = dequantise(values_NLD, scale_NL, torch.float32)
    bound_NLD = fp8_bound(x_NLD)
    assert ((back_NLD - x_NLD).abs() <= bound_NLD).all()
    assert torch.equal(back_NLD[5, 1], torch.zeros(256)) and torch.isfinite(scale_NL).all()
    # each amax maps to 448, which e4m3 holds exactly: it comes back but for fp32's rounding of x / s * s
    torch.testing.assert_close(back_NLD.abs().amax(-1), x_NLD.abs().amax(-1), rtol=1e-6, atol=0)
    # bf16 states, as a target gives them, quantise alike
    bf16_NLD = x_NLD.bfloat16()
    assert ((dequantise(*quantise_fp8(bf16_NLD), torch.float32) - bf16_NLD.float()).abs()
            <= fp8_bound(bf16_NLD.float())).all()


def test_a_non_finite_state_spoils_its_own_position_and_layer_only():
    x_NLD = torch.randn(4, 2, 8)
    x_NLD[1, 0, 3] = float("inf")
    back_NLD = dequantise(*quantise_fp8(x_NLD), torch.float32)
    finite_NL = torch.isfinite(back_NLD).all(-1)
    assert finite_NL.tolist() == [[True, True], [False, True], [True, True], [True, True]]


def _samples(n: int, spec: FeatureSpec, seed: int = 0) -> list[FeatureSample]:
    """Rows of 3-14 tokens, each with 2 response tokens, shipped as a worker ships them (sample_tensors)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        T = 3 + (5 * i) % 12
        row = TokenizedRow(100 + i, tuple(torch.randint(0, 50, (T,), generator=g).tolist()), (0,) * (T - 2) + (1, 1))
        states_TLD = torch.randn(T, len(spec.layer_ids), 8, generator=g) * 10 ** torch.randn(T, 3, 1, generator=g)
        spans = spec.row_spans(row.loss_mask)
        sample = FeatureSample(row.row_id, **sample_tensors(row, states_TLD, spec), context_start=spans.context_start,
                               response_start=spans.response_start)
        sample.check(spec, 8)
        assert {k: (t.dtype, tuple(t.shape)) for k, t in sample.tensors().items()} == sample_layout(row, spec, 8)
        out.append(sample)
    return out


def _on_device(batch):
    return {name: t for name, t in batch.to(torch.device("cpu"), torch.float32).tensors().items()}


@pytest.mark.parametrize("pad_to", [None, 96])
def test_packs_of_fp8_samples_read_as_their_dequantised_samples(pad_to):
    samples = _samples(12, FP8_SPEC)
    assert samples[0].hidden_TLD.dtype == torch.float8_e4m3fn and samples[0].response_scale_RL is not None
    plain = [s.dequantised() for s in samples]
    assert plain[0].hidden_TLD.dtype == torch.float32 and plain[0].hidden_scale_TL is None
    packed = pack(samples, FP8_SPEC, pad_to)
    assert packed.hidden_TLD.dtype == torch.float8_e4m3fn  # fp8 until the device
    with pytest.raises(ValueError, match="fp8 with their scales beside them: read them after .to"):
        packed.layers([1])
    want = _on_device(pack(plain, FP8_SPEC, pad_to))
    got = _on_device(packed)
    assert set(got) == set(want) and "hidden_scale_TL" not in got
    for name in want:
        assert torch.equal(got[name], want[name]), name
    # The feed's path: arrivals in any order, each copied into its pack's (fp8 and scale) buffers at once.
    rows = ListRows([TokenizedRow(s.row_id, tuple(s.input_ids_T.tolist()), tuple(s.loss_mask_T.int().tolist()))
                     for s in samples])
    assembler = PackAssembler(rows, [5, 7], FP8_SPEC, pad_to)
    built = [b for i in np.random.default_rng(0).permutation(12) if (b := assembler.add(samples[i])) is not None]
    assert [b.row_ids for b in sorted(built, key=lambda b: b.row_ids)] == [tuple(range(100, 105)),
                                                                            tuple(range(105, 112))]
    for b in built:
        expected = _on_device(pack([p for p in plain if p.row_id in b.row_ids], FP8_SPEC, pad_to))
        assembled = _on_device(b)
        for name in expected:
            assert torch.equal(assembled[name], expected[name]), name
