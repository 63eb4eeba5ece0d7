"""The MTP drafter's checkpoint surgery: its weights live inside the target's checkpoint as `mtp.*` tensors.

Read: the target's mtp.* tensors, prefix stripped and experts fused (specdistill.kernels.moe.fuse_expert_weights), as the
drafter's state dict. Write: the export is a copy of the target checkpoint (hardlinks where possible) with only
the safetensors holding mtp.* tensors rewritten (experts split back where the checkpoint keeps one tensor per
expert).
"""

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from specdistill.core.fp8 import FP8, dequantize_blockwise, quantize_blockwise
from specdistill.kernels.moe import fuse_expert_weights

PREFIX = "mtp."
SCALE_SUFFIX = "_scale_inv"  # an FP8 weight's block scales (specdistill/core/fp8.py)
WEIGHTS_INDEX = "model.safetensors.index.json"


def mtp_files(path: Path) -> dict[str, list[str]]:
    """{safetensors file name: [mtp.* tensor names in it]}, from the index when sharded."""
    index = path / WEIGHTS_INDEX
    if index.is_file():
        out: dict[str, list[str]] = {}
        for name, file in json.loads(index.read_text())["weight_map"].items():
            if name.startswith(PREFIX):
                out.setdefault(file, []).append(name)
        return out
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        names = [k for k in f.keys() if k.startswith(PREFIX)]
    return {"model.safetensors": names} if names else {}


def read_mtp_state(path: Path, want: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint's mtp.* tensors (prefix stripped, experts fused, fp32) for the keys of `want`. An FP8 weight
    (float8_e4m3fn beside its `<name>_scale_inv`, vLLM's fp8 layout: specdistill/core/fp8.py) is dequantized with its scales."""
    raw = {}
    for file, names in mtp_files(path).items():
        with safe_open(str(path / file), framework="pt") as f:
            for n in names:
                if n.endswith(SCALE_SUFFIX):
                    continue
                t = f.get_tensor(n)
                if t.dtype == FP8:
                    if n + SCALE_SUFFIX not in names:
                        raise ValueError(f"{path / file}: {n} is float8_e4m3fn but {n + SCALE_SUFFIX} is missing; "
                                         "an FP8 weight needs its block scales")
                    t = dequantize_blockwise(t, f.get_tensor(n + SCALE_SUFFIX))
                raw[n[len(PREFIX):]] = t.float()
    state = fuse_expert_weights({k: v for k, v in raw.items() if not k.startswith("layers.") or
                                 k.startswith("layers.0.")})
    missing = sorted(set(want) - set(state))
    if missing:
        raise KeyError(f"{path}: the checkpoint lacks mtp tensors {['mtp.' + m for m in missing[:8]]} "
                       f"({len(missing)} missing); drafter=mtp needs the target's own MTP head")
    bad = [k for k in want if tuple(state[k].shape) != tuple(want[k].shape)]
    if bad:
        raise ValueError(f"{path}: mtp tensor shapes differ from config.json for {bad[:8]}")
    return {k: state[k] for k in want}


def unfuse_expert_weights(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of specdistill.kernels.moe.fuse_expert_weights: experts.gate_up_proj [E, 2I, D] -> experts.e.gate/up_proj."""
    out = {}
    for key, value in state.items():
        if key.endswith("experts.gate_up_proj"):
            base = key[: -len("gate_up_proj")]
            for e, (gate, up) in enumerate(zip(*value.chunk(2, dim=1))):
                out[f"{base}{e}.gate_proj.weight"], out[f"{base}{e}.up_proj.weight"] = gate, up
        elif key.endswith("experts.down_proj"):
            base = key[: -len("down_proj")]
            out.update({f"{base}{e}.down_proj.weight": w for e, w in enumerate(value)})
        else:
            out[key] = value
    return out


def _block_size(src: Path, q: torch.Tensor, scale_inv: torch.Tensor) -> int:
    """The checkpoint's FP8 block: config.json quantization_config.weight_block_size, else read off the scales."""
    config = json.loads((src / "config.json").read_text())
    block = (config.get("quantization_config") or {}).get("weight_block_size")
    if block:
        if block[0] != block[1]:
            raise ValueError(f"{src}: weight_block_size {block} is not square; only square FP8 blocks are written")
        return int(block[0])
    return -(-q.shape[0] // scale_inv.shape[0])


def _link_or_copy(src: Path, dst: Path) -> None:
    if dst.exists() or dst.is_symlink():
        dst.unlink()
    try:
        os.link(src, dst)
    except OSError:  # another filesystem, or links not allowed
        shutil.copy2(src, dst)


def write_back_mtp(src: Path, out_dir: Path, state: dict[str, torch.Tensor]) -> None:
    """Copy checkpoint `src` to `out_dir`, rewriting only the safetensors that hold mtp.* tensors. A weight the
    checkpoint stores in FP8 is quantized again, with new block scales, in the checkpoint's block size (its
    config's weight_block_size): the export is read back as the fine-tuned weights to FP8 precision, never as new
    values under the old scales."""
    out_dir.mkdir(parents=True, exist_ok=True)
    files = mtp_files(src)
    tuned = {PREFIX + k: v.detach().cpu() for k, v in state.items()}
    on_disk = {n for names in files.values() for n in names if not n.endswith(SCALE_SUFFIX)}
    fused = set(tuned) - on_disk
    if fused:  # the checkpoint keeps one tensor per expert
        tuned = {PREFIX + k: v.detach().cpu() for k, v in unfuse_expert_weights(state).items()}
    unknown = sorted(set(tuned) - on_disk)
    if unknown:
        raise KeyError(f"{src}: exported tensors {unknown[:8]} have no counterpart in the checkpoint")
    for entry in src.iterdir():
        if entry.is_file() and entry.name not in files:
            _link_or_copy(entry, out_dir / entry.name)
    for file, names in files.items():
        with safe_open(str(src / file), framework="pt") as f:
            metadata = f.metadata()
            tensors = {n: f.get_tensor(n) for n in f.keys()}
        for name in names:
            if name not in tuned:
                continue
            value = tuned[name].reshape(tensors[name].shape)
            if tensors[name].dtype == FP8:
                tensors[name], tensors[name + SCALE_SUFFIX] = quantize_blockwise(value, _block_size(src, tensors[name],
                                                                                 tensors[name + SCALE_SUFFIX]))
            else:
                tensors[name] = value.to(tensors[name].dtype).contiguous()
        dst = out_dir / file
        if dst.exists():
            dst.unlink()  # never write through a hardlink into the target's own file
        save_file(tensors, str(dst), metadata=metadata)
