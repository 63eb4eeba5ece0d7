"""`small-real`: a small Llama pretrained here on real text, the development target drafters are judged on.

The tiny targets (specdistill/launch/targets.py) are fitted on templated JSON and reward memorising templates. This one is a
real small language model: a byte-level BPE tokenizer and a 6-layer Llama pretrained from scratch on the Python
standard library's source (specdistill/data/corpus.py), so its continuations depend on the context the way a real LM's do.

    specdistill-make-target small-real DIR            # ~40 min on 2 cores; resumable (DIR/pretrain_state.pt)
    specdistill-make-target small-real DIR --fit-steps 5   # the first 5 steps (what the test replays)

The build is deterministic (fixed seeds, SMALL_REAL.threads intra-op threads, fixed data order): the same corpus
gives the same tokenizer.json and the same weights. The finished checkpoint is committed under
specdistill/launch/assets/small-real/ with build_info.json (corpus digest, losses, the weights' digest after the first steps,
held-out loss, own-sample entropy), so nobody has to pretrain it again; tests/launch/test_small_real.py replays the
first steps and checks the digest.

Weights are stored in bf16 (half the bytes in git) and the config says float32: transformers, vLLM and the trainer
all load the same rounded values and compute in fp32, where vLLM's CPU path is exact.
"""

import hashlib
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from specdistill.data.corpus import corpus_files, digest, split
from specdistill.launch.tokenizer import MASK_TOKEN, PAD_TOKEN, SPECIAL_TOKENS, CHAT_TEMPLATE, train_tokenizer


EOT_TOKEN = PAD_TOKEN  # <|endoftext|> separates files in pretraining and ends a sample
DIGEST_STEPS = 5  # build_info.json records the weights' digest after this many steps (the test replays them)


@dataclass(frozen=True)
class SmallRealSpec:
    vocab_size: int = 4096
    hidden_size: int = 256
    num_layers: int = 6
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64  # on vLLM's list of supported head sizes
    intermediate_size: int = 768
    seq_len: int = 512
    batch_size: int = 16  # sequences per step: 8,192 tokens
    steps: int = 1200  # 9.8M tokens, ~1.2 passes over the 8.5M training tokens
    lr: float = 3e-3
    warmup_steps: int = 50
    final_lr_fraction: float = 0.05
    weight_decay: float = 0.1
    seed: int = 0
    threads: int = 2  # pinned: float reduction order depends on it
    checkpoint_every: int = 100


SMALL_REAL = SmallRealSpec()


def model_config(spec: SmallRealSpec, tokenizer: Tokenizer) -> LlamaConfig:
    eot = tokenizer.token_to_id(EOT_TOKEN)
    config = LlamaConfig(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads, head_dim=spec.head_dim,
        intermediate_size=spec.intermediate_size, max_position_embeddings=2048, rope_theta=10000.0,
        tie_word_embeddings=True, bos_token_id=None, eos_token_id=eot, pad_token_id=eot, dtype="float32")
    config.architectures = ["LlamaForCausalLM"]
    return config


def tokenizer_config() -> dict:
    added = {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                      "special": True} for i, t in enumerate(SPECIAL_TOKENS)}
    return {"tokenizer_class": "PreTrainedTokenizerFast", "added_tokens_decoder": added, "bos_token": None,
            "eos_token": EOT_TOKEN, "pad_token": EOT_TOKEN, "unk_token": None, "mask_token": MASK_TOKEN,
            "model_max_length": 2048, "clean_up_tokenization_spaces": False, "chat_template": CHAT_TEMPLATE}


def token_stream(tokenizer: Tokenizer, texts: list[str]) -> torch.Tensor:
    """All texts as one int64 stream, each followed by <|endoftext|>."""
    eot = tokenizer.token_to_id(EOT_TOKEN)
    ids: list[int] = []
    for enc in tokenizer.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eot)
    return torch.tensor(ids, dtype=torch.long)


def lr_factor(step: int, spec: SmallRealSpec) -> float:
    """Linear warm-up, then cosine decay to final_lr_fraction."""
    if step < spec.warmup_steps:
        return (step + 1) / spec.warmup_steps
    progress = min(1.0, (step - spec.warmup_steps) / max(1, spec.steps - spec.warmup_steps))
    return spec.final_lr_fraction + (1 - spec.final_lr_fraction) * 0.5 * (1 + math.cos(math.pi * progress))


def weights_digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode() + t.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()


def _optimizer(model: torch.nn.Module, spec: SmallRealSpec) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.ndim == 2]
    other = [p for p in model.parameters() if p.ndim != 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": spec.weight_decay},
                              {"params": other, "weight_decay": 0.0}], lr=spec.lr, betas=(0.9, 0.95))


def pretrain(model: LlamaForCausalLM, tokens: torch.Tensor, spec: SmallRealSpec, steps: int,
             state_path: Path | None = None, log=print) -> dict:
    """Next-token CE on random seq_len windows of the stream. Resumes bit-exactly from state_path if present."""
    opt = _optimizer(model, spec)
    gen = torch.Generator().manual_seed(spec.seed + 1)
    start, losses, digests = 0, [], {}
    if state_path is not None and state_path.is_file():
        state = torch.load(state_path, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        gen.set_state(state["generator"])
        start, losses, digests = state["step"], state["losses"], state["digests"]
        log(f"[small-real] resumed at step {start} from {state_path}")
    model.train()
    t0 = time.perf_counter()
    for step in range(start, steps):
        for group in opt.param_groups:
            group["lr"] = spec.lr * lr_factor(step, spec)
        offsets = torch.randint(0, tokens.numel() - spec.seq_len - 1, (spec.batch_size,), generator=gen)
        batch_BT = torch.stack([tokens[o:o + spec.seq_len] for o in offsets.tolist()])
        loss = model(input_ids=batch_BT, labels=batch_BT).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(round(loss.item(), 5))
        done = step + 1
        if done == DIGEST_STEPS:
            digests[str(done)] = weights_digest(model)
        if done % 50 == 0:
            rate = (done - start) * spec.batch_size * spec.seq_len / (time.perf_counter() - t0)
            log(f"[small-real] step {done}/{steps} loss {sum(losses[-50:]) / 50:.3f} ({rate:.0f} tokens/s)")
        if state_path is not None and (done % spec.checkpoint_every == 0 or done == steps):
            tmp = state_path.with_suffix(".tmp")
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "generator": gen.get_state(),
                        "step": done, "losses": losses, "digests": digests}, tmp)
            tmp.replace(state_path)
    model.eval()
    return {"losses": losses, "digests": digests}


@torch.no_grad()
def heldout_loss(model: LlamaForCausalLM, tokens: torch.Tensor, seq_len: int, max_windows: int = 64) -> float:
    """Mean next-token CE (nats/token) over consecutive windows of held-out text."""
    n = min(max_windows, (tokens.numel() - 1) // seq_len)
    windows = tokens[: n * seq_len].view(n, seq_len)
    losses = [model(input_ids=w[None], labels=w[None]).loss.item() for w in windows]
    return sum(losses) / len(losses)


@torch.no_grad()
def own_sample_entropy(model: LlamaForCausalLM, prompts: list[list[int]], new_tokens: int = 64,
                       seed: int = 0) -> float:
    """Mean entropy (nats/token) of the model's next-token distribution along its own samples at temperature 1."""
    torch.manual_seed(seed)
    total, count = 0.0, 0
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0,
                             top_p=1.0, max_new_tokens=new_tokens, output_scores=True, return_dict_in_generate=True,
                             pad_token_id=model.config.pad_token_id, eos_token_id=None)
        for scores in out.scores:
            logp = torch.log_softmax(scores.float(), -1)
            total += float(-(logp.exp() * logp).sum())
            count += 1
    return total / max(count, 1)


def make_small_real(out_dir: str | Path, steps: int | None = None, spec: SmallRealSpec = SMALL_REAL,
                    log=print, measure: bool = True) -> Path:
    """Build the tokenizer and pretrain; write a complete HF checkpoint and build_info.json into out_dir.

    measure=False leaves the held-out loss and own-sample entropy out of build_info.json (None): a replay of the
    first steps (tests/launch/test_small_real.py) reads neither, and on 2 cores they take longer than the steps."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    steps = spec.steps if steps is None else steps
    threads = torch.get_num_threads()
    torch.set_num_threads(spec.threads)
    try:
        t0 = time.perf_counter()
        files = corpus_files()
        train_files, heldout_files = split(files)
        tokenizer = train_tokenizer([f.text for f in train_files], spec.vocab_size)
        tokenizer.save(str(out_dir / "tokenizer.json"))
        (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")
        train_tokens = token_stream(tokenizer, [f.text for f in train_files])
        heldout_tokens = token_stream(tokenizer, [f.text for f in heldout_files])
        log(f"[small-real] corpus: {len(train_files)} train files ({train_tokens.numel():,} tokens), "
            f"{len(heldout_files)} held-out files ({heldout_tokens.numel():,} tokens)")
        config = model_config(spec, tokenizer)
        torch.manual_seed(spec.seed)
        model = LlamaForCausalLM(config).float()
        result = pretrain(model, train_tokens, spec, steps, state_path=out_dir / "pretrain_state.pt", log=log)
        _save_rounded(model, out_dir)
        model = LlamaForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()  # what everyone loads
        prompts = [heldout_tokens[i * 997: i * 997 + 64].tolist() for i in range(16)]
        info = {
            "spec": asdict(spec), "steps": steps, "corpus_digest": digest(files),
            "train_files": len(train_files), "heldout_files": len(heldout_files),
            "train_tokens": train_tokens.numel(), "heldout_tokens": heldout_tokens.numel(),
            "parameters": sum(p.numel() for p in model.parameters()),
            "tokenizer_sha256": hashlib.sha256((out_dir / "tokenizer.json").read_bytes()).hexdigest(),
            "weights_digest_after_steps": result["digests"], "loss_first": result["losses"][:10],
            "loss_last_50_mean": sum(result["losses"][-50:]) / max(1, len(result["losses"][-50:])),
            "heldout_loss_nats": heldout_loss(model, heldout_tokens, spec.seq_len) if measure else None,
            "own_sample_entropy_nats": own_sample_entropy(model, prompts) if measure else None,
            "build_seconds": round(time.perf_counter() - t0, 1), "torch": torch.__version__,
        }
        (out_dir / "build_info.json").write_text(json.dumps(info, indent=2) + "\n")
        measured = (f"held-out loss {info['heldout_loss_nats']:.3f} nats/token, own-sample entropy "
                    f"{info['own_sample_entropy_nats']:.3f} nats/token, " if measure else "")
        log(f"[small-real] {measured}{info['build_seconds']:.0f} s")
    finally:
        torch.set_num_threads(threads)
    return out_dir


def _save_rounded(model: LlamaForCausalLM, out_dir: Path) -> None:
    """HF checkpoint with the weights rounded to bf16 on disk (config dtype float32), sorted keys, fixed metadata."""
    model.save_pretrained(out_dir, safe_serialization=True)
    tensors = load_file(out_dir / "model.safetensors")
    save_file({k: tensors[k].to(torch.bfloat16).contiguous() for k in sorted(tensors)},
              out_dir / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out_dir / "config.json").read_text())
    config["dtype"] = "float32"
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    GenerationConfig(do_sample=False, eos_token_id=model.config.eos_token_id,
                     pad_token_id=model.config.pad_token_id).save_pretrained(out_dir)
