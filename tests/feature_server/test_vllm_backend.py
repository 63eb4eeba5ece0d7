"""VLLMBackend (real vLLM, extract_hidden_states + RingHiddenStatesConnector) against a transformers reference, and
its hand-off: states written by the engine straight into a ShmChannel ring, no per-request file.

Reference convention (specdistill/core/contract.py): id 0 = output of embed_tokens, id k = transformers'
hidden_states[k] (after k decoder layers), id L = the input of the final norm (transformers' last hidden_states
entry is post-norm). One engine per target per module: the llama engine serves every llama test; the Qwen3-Next
engine extracts once and is shut down inside its fixture.
"""

import glob
import json
import os
import uuid

import pytest
import torch

from specdistill.core.contract import FeatureSample, FeatureSpec, TokenizedRow
from specdistill.feature_server import vllm_backend
from specdistill.feature_server.hf_backend import HFBackend
from specdistill.feature_server.shm_transport import LocalRegion, ShmChannel, segment_paths
from specdistill.feature_server.vllm_backend import VLLMBackend
from tests.feature_server.rows import fp8_bound
from tests.files import build_random_target

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MAX_MODEL_LEN = 256
# Odd, as a longest-row-plus-one limit usually is: unrounded, the hybrid target's hidden-state cache would take a
# linear-attention page per token (7,001 x 160 KiB > the 1 GiB of VLLM_CPU_KVCACHE_SPACE on a CPU with AVX512-BF16,
# where vLLM keeps that state in fp32) and the engine would not start (vllm_backend.engine_length).
QWEN_MAX_MODEL_LEN = 7001
ALL_LAYERS = (0, 1, 2, 3, 4)  # every id of a 4-layer target
QWEN_LAYERS = (1, 3, 4)  # a subset with a gap: after linear-attention layers 1 and 3, after the full-attention one


def make_rows(vocab_size: int, lengths=(9, 16, 23)) -> list[TokenizedRow]:
    g = torch.Generator().manual_seed(0)
    rows = []
    for i, T in enumerate(lengths):
        ids = torch.randint(0, vocab_size, (T,), generator=g).tolist()
        rows.append(TokenizedRow(row_id=100 + i, input_ids=tuple(ids), loss_mask=(0,) * (T // 2) + (1,) * (T - T // 2)))
    return rows


def reference_states(target_dir, row: TokenizedRow, layer_ids) -> torch.Tensor:
    """[T, len(layer_ids), D] from transformers in fp32, by hooks (see the module docstring)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    captured = {}
    hooks = [model.model.embed_tokens.register_forward_hook(lambda m, a, out: captured.__setitem__("emb", out)),
             model.model.norm.register_forward_pre_hook(lambda m, a: captured.__setitem__("pre_norm", a[0]))]
    with torch.no_grad():
        out = model(input_ids=torch.tensor([row.input_ids]), output_hidden_states=True)
    for h in hooks:
        h.remove()
    L = model.config.num_hidden_layers
    picked = [captured["emb"] if k == 0 else captured["pre_norm"] if k == L else out.hidden_states[k]
              for k in layer_ids]
    return torch.stack([p[0] for p in picked], dim=1)


def assert_matches_reference(got_TLD, all_ref_TLD, layer_ids, rel_tol: float, abs_tol: float = 0.0) -> None:
    """got (spec layers) vs the reference at every id 0..L: within tolerance of its own layer, and clearly off
    from the neighbouring ids, so a layer-id shift (which vLLM serves without error) would fail here.

    tolerance for id k = abs_tol + rel_tol * max |reference at k|.
    """
    L1 = all_ref_TLD.shape[1]
    for j, k in enumerate(layer_ids):
        tol = abs_tol + rel_tol * all_ref_TLD[:, k].abs().max().item()
        err = (got_TLD[:, j].float() - all_ref_TLD[:, k]).abs().max().item()
        assert err <= tol, f"layer id {k}: max abs error {err:.3g} > tolerance {tol:.3g}"
        for n in (k - 1, k + 1):
            if 0 <= n < L1:
                off = (got_TLD[:, j].float() - all_ref_TLD[:, n]).abs().max().item()
                assert off > 4 * tol, f"layer id {k} is as close to id {n} ({off:.3g}) as tolerance {tol:.3g}"


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return build_random_target("tiny-llama", tmp_path_factory)


@pytest.fixture(scope="module")
def llama_backend(tiny_llama):
    backend = VLLMBackend(tiny_llama, FeatureSpec(ALL_LAYERS, hidden_dtype="float32"), device="cpu",
                          dtype="float32", max_model_len=MAX_MODEL_LEN)
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def qwen3_next_case(tmp_path_factory):
    """(target_dir, rows, states): bf16 engine started, used once, shut down before the tests run.

    The target routes every token to all 4 experts (num_experts_per_tok 2 -> 4; same weights). With top-2 routing
    a router near-tie (seen: 2nd/3rd expert logits 9e-4 apart on a fitted tiny target) flips under bf16 and
    puts a 10% error on that token - MoE numerics, not extraction. All-expert routing keeps the layers continuous.
    """
    target = build_random_target("tiny-qwen3-next", tmp_path_factory)
    config_path = os.path.join(target, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["num_experts_per_tok"] = config["num_experts"]
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2)
    backend = VLLMBackend(target, FeatureSpec(QWEN_LAYERS, hidden_dtype="bfloat16"), device="cpu", dtype=None,
                          max_model_len=QWEN_MAX_MODEL_LEN)
    try:
        rows = make_rows(backend.vocab_size)
        states = backend.extract(rows)
    finally:
        backend.close()
    return target, rows, states


def test_llama_states_match_transformers(llama_backend, tiny_llama):
    rows = make_rows(llama_backend.vocab_size)
    states = llama_backend.extract(rows)
    assert [s.shape for s in states] == [(r.num_tokens, len(ALL_LAYERS), 128) for r in rows]
    assert all(s.dtype == torch.float32 for s in states)
    for row, got in zip(rows, states):
        ref = reference_states(tiny_llama, row, ALL_LAYERS)
        # fp32 engine vs fp32 transformers: only summation order differs (seen <= 2e-7 at |h| ~ 0.3), so
        # 1e-5 + 1e-5 * max|h| has ~50x headroom while neighbouring layers differ by ~0.1.
        assert_matches_reference(got, ref, ALL_LAYERS, rel_tol=1e-5, abs_tol=1e-5)


def test_an_engine_in_the_calling_process_gives_the_same_states(llama_backend, tiny_llama, tmp_path):
    """feature_server.engine_in_worker (VLLM_ENABLE_V1_MULTIPROCESSING=0 in the worker's process): the engine runs
    in the process that builds it, no engine-core process, and the states are bit-identical to vLLM's own layout's
    (the module's engine). Run in a process of its own, as a feature worker is (docs/vllm.md)."""
    import subprocess
    import sys

    from tests.cli import REPO

    rows = make_rows(llama_backend.vocab_size)
    script = f"""
import os, sys, torch
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from specdistill.core.contract import FeatureSpec
from specdistill.feature_server.vllm_backend import VLLMBackend
from tests.feature_server.test_vllm_backend import ALL_LAYERS, MAX_MODEL_LEN, make_rows
if __name__ == "__main__":
    backend = VLLMBackend({str(tiny_llama)!r}, FeatureSpec(ALL_LAYERS, hidden_dtype="float32"), device="cpu",
                          dtype="float32", max_model_len=MAX_MODEL_LEN)
    client = type(backend._llm.llm_engine.engine_core).__name__
    torch.save({{"client": client, "states": backend.extract(make_rows(backend.vocab_size))}}, sys.argv[1])
    backend.close()
"""
    out = tmp_path / "states.pt"
    proc = subprocess.run([sys.executable, "-c", script, str(out)], capture_output=True, text=True, timeout=300,
                          cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = torch.load(out)
    assert got["client"] == "InprocClient"
    for row, a, b in zip(rows, got["states"], llama_backend.extract(rows)):
        assert torch.equal(a, b), f"row {row.row_id}: max diff {(a - b).abs().max().item():.3g}"


def test_a_batched_prefill_gives_each_row_the_states_of_its_own_prefill(llama_backend):
    """Rows handed to the engine together (one scheduler step: 205 tokens <= max_num_batched_tokens) get the states
    each gets alone: batching changes throughput, never what the trainer sees."""
    rows = make_rows(llama_backend.vocab_size, lengths=(9, 40, 16, 23, 57, 60))
    batched = llama_backend.extract(rows)
    for row, got in zip(rows, batched):
        alone = llama_backend.extract([row])[0]
        torch.testing.assert_close(got, alone, rtol=1e-5, atol=1e-5)  # fp32: summation order at most


def test_the_engine_length_rounds_up_to_a_multiple_of_1024_within_the_context():
    """An odd max_model_len gives a hybrid target's hidden-state cache blocks of one token, each a whole
    linear-attention page (vllm_backend.engine_length): the engine starts with a rounded length instead."""
    assert vllm_backend.engine_length(8953, 32768) == 9216
    assert vllm_backend.engine_length(2048, 32768) == 2048
    assert vllm_backend.engine_length(4097, 5000) == 5000  # never past the target's context
    assert vllm_backend.engine_length(64, 64) == 64


def test_properties_and_row_checks(llama_backend):
    assert (llama_backend.num_hidden_layers, llama_backend.hidden_size) == (4, 128)
    assert llama_backend.extract([]) == []
    too_long = TokenizedRow(row_id=7, input_ids=(1,) * (MAX_MODEL_LEN + 1), loss_mask=(0,) * (MAX_MODEL_LEN + 1))
    with pytest.raises(ValueError, match="row 7.*max_model_len"):
        llama_backend.extract([too_long])
    bad_token = TokenizedRow(row_id=8, input_ids=(1, 10**6), loss_mask=(0, 1))
    with pytest.raises(ValueError, match="row 8"):
        llama_backend.extract([bad_token])


def test_qwen3_next_states_match_transformers(qwen3_next_case):
    target, rows, states = qwen3_next_case
    assert [s.shape for s in states] == [(r.num_tokens, len(QWEN_LAYERS), 128) for r in rows]
    assert all(s.dtype == torch.bfloat16 for s in states)
    for row, got in zip(rows, states):
        ref = reference_states(target, row, ALL_LAYERS)
        # bf16 engine vs fp32 transformers. bf16 keeps 8 significant bits (relative spacing 2^-7), and every
        # layer's output is rounded to it before the next layer: with 4 layers a few ulps accumulate, plus one
        # final rounding to spec.hidden_dtype. Tolerance: 2^-6 (two ulps) of each layer's largest magnitude.
        # Seen: <= 8.5e-4 at max |h| ~ 0.14 (tol 2.2e-3); neighbouring layers differ by >= 0.013.
        assert_matches_reference(got, ref, QWEN_LAYERS, rel_tol=2**-6)


@pytest.mark.parametrize("layer_ids", [(1, 5), (-1, 2)])
def test_out_of_range_layer_ids_raise_before_engine_start(tiny_llama, layer_ids):
    with pytest.raises(ValueError, match=r"out of range.*valid ids are 0\.\.4"):
        VLLMBackend(tiny_llama, FeatureSpec(layer_ids), device="cpu")


def _handoff_files() -> set[str]:
    """Files a file-based hand-off would leave: the stock connector's per-request safetensors + lock files (its
    default directory is /tmp) and any scratch directory in /dev/shm. Test temp dirs (/tmp/pytest-of-*) are left
    out: under pytest-xdist the other worker writes checkpoints and exports there meanwhile."""
    found = {p for p in glob.glob("/dev/shm/*") if os.path.isdir(p)}
    for root in ["/dev/shm", *(p for p in glob.glob("/tmp/*") if not os.path.basename(p).startswith("pytest-of-"))]:
        for pattern in ("*.safetensors", "*.safetensors.lock", "*-hs-*"):
            found.update(glob.glob(os.path.join(root, "**", pattern), recursive=True))
    return found


@pytest.mark.parametrize("hidden_dtype", ["float32", "bfloat16"])
def test_states_go_straight_into_the_ring_and_match_the_hf_backend(llama_backend, tiny_llama, monkeypatch,
                                                                   hidden_dtype):
    spec = FeatureSpec(ALL_LAYERS, hidden_dtype=hidden_dtype)
    monkeypatch.setattr(llama_backend, "spec", spec)  # same engine and layers; only the region's dtype changes
    rows = make_rows(llama_backend.vocab_size)
    expected = dict(zip([r.row_id for r in rows], HFBackend(tiny_llama, spec).extract(rows)))
    before = _handoff_files()
    prefix = f"sdtest_{uuid.uuid4().hex[:10]}"
    with ShmChannel(1 << 20, prefix=prefix, handle_signals=False) as ch:
        producer = ch.producer(0)
        llama_backend.publish(rows, producer, {"stream": 7})
        got = {}
        for _ in rows:
            msg = ch.get(timeout=60)
            assert msg.kind == "data" and msg.info["stream"] == 7 and msg.info["extract_s"] > 0
            got[msg.key] = msg.tensors
        assert _handoff_files() == before  # no per-request file, anywhere
        assert segment_paths(prefix) == []  # the ring is mapped on both sides: its name is gone already
        for row in rows:
            sample = got[row.row_id]
            assert sample["input_ids_T"].tolist() == list(row.input_ids)  # written by the engine's connector
            assert sample["loss_mask_T"].tolist() == [bool(m) for m in row.loss_mask]
            assert sample["hidden_TLD"].dtype == spec.torch_dtype  # cast on write
            # fp32: summation order only (see test_llama_states_match_transformers). bf16: both sides round
            # near-equal fp32 values to bf16, so they may land one bf16 step apart (2^-7 relative).
            tol = {"float32": dict(rtol=1e-5, atol=1e-5), "bfloat16": dict(rtol=2**-7, atol=1e-5)}[hidden_dtype]
            torch.testing.assert_close(sample["hidden_TLD"].float(), expected[row.row_id].float(), **tol)
        del got, sample, msg
        assert ch.bytes_in_flight() == 0  # every region came back once its views were dropped
    assert segment_paths(prefix) == []  # nothing of the channel is left in /dev/shm


def test_a_region_the_engine_cannot_write_fails_that_row_and_the_engine_keeps_serving(llama_backend, monkeypatch):
    class WrongInode(LocalRegion):  # the engine opens the path, finds another file, logs, writes nothing
        def __init__(self, key, layout):
            super().__init__(key, layout)
            self.location = {**self.location, "inode": self.location["inode"] + 1}

    rows = make_rows(llama_backend.vocab_size, lengths=(9,))
    monkeypatch.setattr(vllm_backend, "LocalRegion", WrongInode)
    with pytest.raises(RuntimeError, match=f"row {rows[0].row_id}: the vLLM connector wrote nothing"):
        llama_backend.extract(rows)
    monkeypatch.undo()
    assert llama_backend.extract(rows)[0].shape == (9, len(ALL_LAYERS), 128)


def test_the_engine_ships_only_the_positions_a_spec_reads(llama_backend, tiny_llama, monkeypatch):
    """feature_server.positions=read: the connector gathers the context layers from WINDOW tokens before each row's
    first response token and the last layer from that token - 1 (core/contract.py), and writes only those into the
    ring; they equal the transformers backend's states there. Token ids and the loss mask ship whole."""
    window, last = 4, ALL_LAYERS[-1]
    spec = FeatureSpec(ALL_LAYERS, hidden_dtype="float32", context_window=window, response_layer_ids=(last,))
    monkeypatch.setattr(llama_backend, "spec", spec)  # same engine and layers; only the positions change
    rows = make_rows(llama_backend.vocab_size, lengths=(9, 16, 23))  # first response at 4, 8, 11: cut at 0, 4, 7
    whole = dict(zip([r.row_id for r in rows], HFBackend(tiny_llama, FeatureSpec(ALL_LAYERS, "float32")).extract(rows)))
    with ShmChannel(1 << 20, prefix=f"sdtest_{uuid.uuid4().hex[:10]}", handle_signals=False) as ch:
        llama_backend.publish(rows, ch.producer(0), {"stream": 0})
        for _ in rows:
            msg = ch.get(timeout=60)
            row = next(r for r in rows if r.row_id == msg.key)
            spans = spec.row_spans(msg.tensors["loss_mask_T"])
            sample = FeatureSample(msg.key, **msg.tensors, context_start=spans.context_start,
                                   response_start=spans.response_start)
            sample.check(spec, 128)  # what the trainer's ledger checks
            first = row.num_tokens // 2  # make_rows: the second half is the response
            assert (spans.context_start, spans.response_start) == (max(0, first - window), first - 1)
            assert sample.input_ids_T.tolist() == list(row.input_ids)
            ref = whole[row.row_id]  # fp32 engine vs fp32 transformers: summation order only
            torch.testing.assert_close(sample.hidden_TLD, ref[spans.context_start:, :-1], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(sample.response_RLD, ref[spans.response_start:, -1:], rtol=1e-5, atol=1e-5)
            del msg, sample
        assert ch.bytes_in_flight() == 0


def test_fp8_states_are_quantised_in_the_engine_and_come_back_within_the_e4m3_bound(llama_backend, tiny_llama,
                                                                                    monkeypatch):
    """feature_server.hidden_dtype=float8_e4m3fn: the connector quantises what ships on the engine's device and
    writes e4m3 values and a scale per position and layer into the ring; multiplied back (as the trainer's device
    does) they are the transformers backend's fp32 states within e4m3's bound. extract() gives those values."""
    last = ALL_LAYERS[-1]
    spec = FeatureSpec(ALL_LAYERS, hidden_dtype="float8_e4m3fn", context_window=4, response_layer_ids=(last,))
    monkeypatch.setattr(llama_backend, "spec", spec)  # same engine and layers; only what is written changes
    rows = make_rows(llama_backend.vocab_size)
    whole = dict(zip([r.row_id for r in rows], HFBackend(tiny_llama, FeatureSpec(ALL_LAYERS, "float32")).extract(rows)))

    def assert_within_bound(got_NLD, ref_NLD):  # + the fp32 engine's own distance from transformers (1e-5)
        slack_NLD = 1e-5 * (1 + ref_NLD.abs().amax(-1, keepdim=True))
        assert ((got_NLD - ref_NLD).abs() <= fp8_bound(ref_NLD) + slack_NLD).all()

    with ShmChannel(1 << 20, prefix=f"sdtest_{uuid.uuid4().hex[:10]}", handle_signals=False) as ch:
        llama_backend.publish(rows, ch.producer(0), {"stream": 0})
        for _ in rows:
            msg = ch.get(timeout=60)
            spans = spec.row_spans(msg.tensors["loss_mask_T"])
            sample = FeatureSample(msg.key, **msg.tensors, context_start=spans.context_start,
                                   response_start=spans.response_start)
            sample.check(spec, 128)  # fp8 values, fp32 scales of the shipped positions and layers
            assert sample.hidden_TLD.dtype == torch.float8_e4m3fn and sample.hidden_scale_TL is not None
            back, ref = sample.dequantised(), whole[msg.key]
            assert_within_bound(back.hidden_TLD, ref[spans.context_start:, :-1])
            assert_within_bound(back.response_RLD, ref[spans.response_start:, -1:])
            del msg, sample, back
        assert ch.bytes_in_flight() == 0
    extracted = llama_backend.extract(rows[:1])[0]
    assert extracted.dtype == torch.float32 and extracted.shape == whole[rows[0].row_id].shape
    assert_within_bound(extracted, whole[rows[0].row_id])
