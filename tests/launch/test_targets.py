"""Tiny targets: build, load in transformers, layer/norm conventions, mtp.* layout, determinism, vLLM serving."""

import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

import specdistill.launch.targets as targets
from specdistill.launch.targets import TINY_TARGETS, ensure_target, make_target
from specdistill.launch.tokenizer import SPECIAL_TOKENS
from specdistill.data.workload import generate_rows

FIT_STEPS = 2  # exercises the fit path; the real fit (~60 s) is the slow test's business
HYBRIDS = ("tiny-qwen3-next", "tiny-qwen3.5-moe")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("targets")
    return {name: make_target(name, root / name, fit_steps=FIT_STEPS) for name in TINY_TARGETS}


def _tensors(target_dir):
    with safe_open(target_dir / "model.safetensors", "pt") as f:
        return {k: f.get_slice(k) for k in f.keys()}


def _prompt_ids(tok, row):
    text = tok.apply_chat_template(row["messages"][:-1], tokenize=False, add_generation_prompt=True)
    return torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])


@pytest.mark.parametrize("name", list(TINY_TARGETS))
def test_loads_in_transformers(built, name):
    tok = AutoTokenizer.from_pretrained(built[name])
    model, info = AutoModelForCausalLM.from_pretrained(built[name], output_loading_info=True)
    assert not info["missing_keys"], info["missing_keys"]
    assert model.config.vocab_size == len(tok)
    assert tok.eos_token == "<|im_end|>" and all(t in tok.get_vocab() for t in SPECIAL_TOKENS)
    ids_1T = _prompt_ids(tok, generate_rows(1, split="heldout")[0])
    with torch.no_grad():
        logits = model(ids_1T).logits
    assert logits.shape == (1, ids_1T.shape[1], len(tok)) and torch.isfinite(logits).all()


def test_chat_template_in_tokenizer_config(built):
    cfg = json.loads((built["tiny-llama"] / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in cfg["chat_template"] and cfg["eos_token"] == "<|im_end|>"
    tok = AutoTokenizer.from_pretrained(built["tiny-llama"])
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("name", HYBRIDS)
def test_hybrid_layers_and_dtype(built, name):
    cfg = json.loads((built[name] / "config.json").read_text())
    assert cfg["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert cfg["linear_key_head_dim"] == cfg["linear_value_head_dim"] == 128  # vLLM CPU GDN kernel
    assert cfg["head_dim"] == 32 and cfg["num_experts"] == 4 and cfg["num_experts_per_tok"] == 2
    assert cfg["dtype"] == "bfloat16" and cfg["tie_word_embeddings"] is False
    assert {s.get_dtype() for s in _tensors(built[name]).values()} == {"BF16"}


@pytest.mark.parametrize("name, zero_centred", [("tiny-qwen3-next", True), ("tiny-qwen3.5-moe", True),
                                                 ("tiny-llama", False)])
def test_final_norm_convention(built, name, zero_centred):
    model = AutoModelForCausalLM.from_pretrained(built[name], dtype=torch.float32)
    norm = model.model.norm
    x = torch.randn(3, model.config.hidden_size)
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    rms = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    with torch.no_grad():
        norm.weight.fill_(0.5)
        want = rms * (1.5 if zero_centred else 0.5)  # Qwen3-Next / 3.5: x * (1 + w); Llama: x * w
        torch.testing.assert_close(norm(x), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", HYBRIDS)
def test_mtp_weights_layout(built, name):
    tensors = _tensors(built[name])
    cfg = json.loads((built[name] / "config.json").read_text())
    H = cfg["hidden_size"]
    assert cfg[targets.get_spec(name).mtp_layers_key] == 1
    assert tensors["mtp.fc.weight"].get_shape() == [H, 2 * H]
    for k in ("mtp.pre_fc_norm_hidden.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.norm.weight"):
        assert tensors[k].get_shape() == [H]
    # mtp.layers.0 mirrors the target's full-attention MoE decoder layer, key for key and shape for shape.
    full = next(k for k in tensors if k.endswith("layers.3.input_layernorm.weight"))[: -len("input_layernorm.weight")]
    want = {k[len(full):]: tensors[k].get_shape() for k in tensors if k.startswith(full)}
    got = {k[len("mtp.layers.0."):]: v.get_shape() for k, v in tensors.items() if k.startswith("mtp.layers.0.")}
    assert got == want
    assert {"self_attn.q_proj.weight", "mlp.gate.weight", "mlp.experts.3.down_proj.weight",
            "mlp.shared_expert.up_proj.weight", "mlp.shared_expert_gate.weight"} <= set(got)


def test_llama_has_no_mtp(built):
    cfg = json.loads((built["tiny-llama"] / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["dtype"] == "float32" and cfg["num_hidden_layers"] == 4
    assert not [k for k in _tensors(built["tiny-llama"]) if k.startswith("mtp.")]


def test_deterministic_bytes(built, tmp_path):
    again = make_target("tiny-qwen3-next", tmp_path / "again", fit_steps=FIT_STEPS)
    for f in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "config.json"):
        assert (again / f).read_bytes() == (built["tiny-qwen3-next"] / f).read_bytes(), f


def test_unknown_name_lists_valid_names(tmp_path):
    with pytest.raises(KeyError, match="valid names: tiny-qwen3-next, tiny-qwen3.5-moe, tiny-llama"):
        make_target("tiny-gpt", tmp_path)
    with pytest.raises(KeyError, match="valid names"):
        ensure_target("tiny-gpt", tmp_path)


def test_ensure_target_builds_once_and_atomically(tmp_path, monkeypatch):
    calls = []

    def fake_make(name, out_dir, fit_steps=None):
        calls.append(name)
        if len(calls) == 1:  # first build crashes half-way
            (out_dir / "config.json").write_text("{}")
            raise RuntimeError("boom")
        return make_target(name, out_dir, fit_steps=0)

    monkeypatch.setattr(targets, "make_target", fake_make)
    with pytest.raises(RuntimeError, match="boom"):
        ensure_target("tiny-llama", tmp_path)
    assert os.listdir(tmp_path) == [".tiny-llama.lock"]  # no half checkpoint, no temp dir left behind
    path = ensure_target("tiny-llama", tmp_path)
    assert path == tmp_path / "tiny-llama" and targets.is_complete(path)
    assert ensure_target("tiny-llama", tmp_path) == path and len(calls) == 2  # reused, not rebuilt


def test_concurrent_callers_wait_for_one_build(tmp_path, monkeypatch):
    """Two callers at once (two test workers, two runs sharing a cache): one builds, the other waits and reuses
    it, and neither sees the checkpoint replaced under it."""
    calls, started = [], threading.Event()

    def slow_make(name, out_dir, fit_steps=None):
        calls.append(name)
        started.set()
        time.sleep(0.5)  # the second caller arrives mid-build
        return make_target(name, out_dir, fit_steps=0)

    monkeypatch.setattr(targets, "make_target", slow_make)
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(ensure_target, "tiny-llama", tmp_path)
        started.wait(30)
        second = pool.submit(ensure_target, "tiny-llama", tmp_path)
        assert first.result() == second.result() == tmp_path / "tiny-llama"
    assert calls == ["tiny-llama"] and targets.is_complete(tmp_path / "tiny-llama")


# tiny-qwen3.5-moe's fit (~100 s of one core) is the same code as tiny-qwen3-next's with another config class, and
# nothing else in make test trains on it: its check runs in make test-all.
@pytest.mark.slow
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.long) if n == "tiny-qwen3.5-moe" else n
                                  for n in TINY_TARGETS])
def test_fitted_target_greedy_is_structured(tiny_target, name):
    """The default fit turns the degenerate random target into one whose greedy outputs look like the workload.
    The session's targets are that default build (ensure_target -> make_target; the bytes are deterministic, see
    test_deterministic_bytes), so they are checked instead of fitting each a second time."""
    d = tiny_target(name)
    tok = AutoTokenizer.from_pretrained(d)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    for row in generate_rows(26, split="heldout")[::6]:
        ids_1T = _prompt_ids(tok, row)
        out = model.generate(ids_1T, max_new_tokens=32, do_sample=False, eos_token_id=tok.eos_token_id)[0]
        new = out[ids_1T.shape[1]:].tolist()
        assert len(set(new)) >= 8, tok.decode(new)  # a random init repeats one or two tokens
        if row["stage"] != "answer_writing":
            assert tok.decode(new).startswith("{"), tok.decode(new)


@pytest.mark.vllm
def test_qwen3_next_serves_in_vllm(built):
    """vLLM's engine with the settings specdistill/launch/targets.py's docstring gives (specdistill.evaluation.vllm_serve
    .serve: the checkpoint's bf16, eager, no prefix caching on a hybrid target)."""
    pytest.importorskip("vllm")
    from specdistill.evaluation.vllm_serve import serve

    tok = AutoTokenizer.from_pretrained(built["tiny-qwen3-next"])
    rows = generate_rows(2, split="heldout")
    prompts = [tok(tok.apply_chat_template(r["messages"][:-1], tokenize=False, add_generation_prompt=True),
                   add_special_tokens=False)["input_ids"] for r in rows]
    outs = serve(str(built["tiny-qwen3-next"]), prompts, 8, max_model_len=2048).output_token_ids
    assert all(0 < len(o) <= 8 for o in outs)
