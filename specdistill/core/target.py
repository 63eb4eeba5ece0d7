"""The target as the trainer sees it: its config facts, and its frozen output head.

The trainer never loads the whole target. It reads only the embeddings, the final norm and the
lm_head from the checkpoint, and computes the target distribution itself from the last hidden state
(docs/vllm.md: vLLM returns pre-final-norm states, so the final norm is applied here).
"""

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from specdistill.core.fp8 import dequantize_blockwise

# model_type -> whether its RMSNorm computes x_normed * (1 + w) (zero-centred weights).
SUPPORTED_MODEL_TYPES = {
    "llama": False,
    "qwen3": False,
    "qwen3_moe": False,
    "qwen3_next": True,
    "qwen3_5_moe": True,
    "qwen3_5_moe_text": True,
    "qwen3_5": True,
    "qwen3_5_text": True,
}


@dataclass(frozen=True)
class TargetInfo:
    path: Path
    model_type: str
    architectures: tuple[str, ...]
    num_hidden_layers: int
    hidden_size: int
    vocab_size: int
    rms_norm_eps: float
    zero_centred_norm: bool
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    torch_dtype: str
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int | None  # dense MLP width; None for pure-MoE targets
    quantization: str | None = None  # "fp8" for FP8 checkpoints (decoder weights only; see _open_tensor)
    layer_types: tuple[str, ...] = ()  # transformers' per-layer attention types (full_attention, linear_attention)

    @classmethod
    def load(cls, path: str | Path) -> "TargetInfo":
        path = Path(path)
        config_file = path / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"{config_file}: no config.json; target.path must be a local HF checkpoint dir")
        raw = json.loads(config_file.read_text())
        text = raw.get("text_config") or raw  # multimodal wrappers keep the LM config here
        model_type = text.get("model_type") or raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"{config_file}: architecture model_type={model_type!r} is not supported; "
                f"supported: {sorted(SUPPORTED_MODEL_TYPES)}"
            )
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        return cls(
            path=path,
            model_type=model_type,
            architectures=tuple(raw.get("architectures") or ()),
            num_hidden_layers=text["num_hidden_layers"],
            hidden_size=text["hidden_size"],
            vocab_size=text["vocab_size"],
            rms_norm_eps=text.get("rms_norm_eps", 1e-6),
            zero_centred_norm=SUPPORTED_MODEL_TYPES[model_type],
            rope_theta=float(text.get("rope_theta") or rope.get("rope_theta") or 10000.0),
            max_position_embeddings=text.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
            torch_dtype=str(text.get("torch_dtype") or text.get("dtype") or raw.get("torch_dtype") or "float32"),
            num_attention_heads=text["num_attention_heads"],
            num_key_value_heads=text.get("num_key_value_heads") or text["num_attention_heads"],
            head_dim=text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"],
            intermediate_size=text.get("intermediate_size"),
            quantization=(raw.get("quantization_config") or text.get("quantization_config") or {}).get("quant_method"),
            layer_types=tuple(text.get("layer_types") or ("full_attention",) * text["num_hidden_layers"]),
        )


class RMSNorm(nn.Module):
    """RMSNorm in either weight convention: x*w (llama/qwen3) or x*(1+w) (qwen3_next/qwen3_5)."""

    def __init__(self, dim: int, eps: float, zero_centred: bool = False):
        super().__init__()
        self.eps = eps
        self.zero_centred = zero_centred
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centred else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.zero_centred:
            return (normed * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * normed.to(x.dtype)


def _open_tensor(path: Path, candidates: tuple[str, ...]) -> torch.Tensor:
    """Read one tensor by the first matching name, from model.safetensors or a sharded index; an FP8 tensor is
    dequantized with its `<name>_scale_inv` (block-wise) or `<name>_scale` (per tensor / per channel)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = {name: path / weight_map[name] for name in candidates if name in weight_map}
    else:
        files = {name: path / "model.safetensors" for name in candidates}
    for name, file in files.items():
        if not file.is_file():
            continue
        try:
            handle = safe_open(str(file), framework="pt")
        except Exception as err:  # safetensors' own errors do not name the file
            raise ValueError(f"{file}: not a readable safetensors file ({type(err).__name__}: {err}); "
                             "re-download or re-export the target checkpoint") from err
        with handle as f:
            if name in f.keys():
                tensor = f.get_tensor(name)
                if tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                    tensor = _dequantize(path, name, tensor, f)
                return tensor
    raise KeyError(f"{path}: none of {list(candidates)} found in the checkpoint's safetensors")


def _dequantize(path: Path, name: str, q: torch.Tensor, f) -> torch.Tensor:
    keys = set(f.keys())
    if f"{name}_scale_inv" in keys:
        return dequantize_blockwise(q, f.get_tensor(f"{name}_scale_inv"))
    if f"{name}_scale" in keys:
        scale = f.get_tensor(f"{name}_scale").float()
        return q.float() * (scale.view(-1, 1) if scale.numel() > 1 else scale)
    raise ValueError(f"{path}: tensor {name} is {q.dtype} but the checkpoint has no {name}_scale_inv or {name}_scale "
                     "next to it (expected vLLM's fp8 layout)")


def _names(suffix: str) -> tuple[str, ...]:
    return (f"model.{suffix}", f"model.language_model.{suffix}", suffix)


def read_tensor(info: TargetInfo, suffix: str) -> torch.Tensor | None:
    """A decoder tensor by its name under the model (e.g. "layers.3.mlp.up_proj.weight"), or None if absent."""
    try:
        return _open_tensor(info.path, _names(suffix))
    except KeyError:
        return None


class TargetHead(nn.Module):
    """Frozen embeddings, final norm and lm_head of the target."""

    def __init__(self, info: TargetInfo):
        super().__init__()
        self.info = info
        embed = _open_tensor(info.path, _names("embed_tokens.weight")).float()
        self.embed_tokens = nn.Embedding.from_pretrained(embed, freeze=True)
        self.norm = RMSNorm(info.hidden_size, info.rms_norm_eps, info.zero_centred_norm)
        self.norm.weight.data.copy_(_open_tensor(info.path, _names("norm.weight")).float())
        lm_head = embed if info.tie_word_embeddings else _open_tensor(info.path, ("lm_head.weight",)).float()
        self.lm_head = nn.Linear(info.hidden_size, lm_head.shape[0], bias=False)
        self.lm_head.weight.data.copy_(lm_head)
        self.requires_grad_(False)

    def logits(self, last_hidden_ND: torch.Tensor) -> torch.Tensor:
        """Target logits from pre-final-norm last-layer states (only the positions passed in)."""
        return self.lm_head(self.norm(last_hidden_ND.to(self.lm_head.weight.dtype)))

    @torch.no_grad()
    def argmax(self, last_hidden_ND: torch.Tensor, chunk: int = 4096) -> torch.Tensor:
        """Greedy target tokens, in chunks so no [N, vocab] tensor is built for a whole pack."""
        out = [self.logits(part).argmax(-1) for part in last_hidden_ND.split(chunk)]
        return torch.cat(out) if out else last_hidden_ND.new_zeros(0, dtype=torch.long)
