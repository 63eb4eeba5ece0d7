"""Write an FP8 copy of a target checkpoint, in the layout vLLM's fp8 checkpoints use.

    specdistill-make-fp8 SRC_DIR DST_DIR [--block 128]

Decoder projection weights (2-D `*_proj.weight` inside `model.layers.*`, experts included) become
float8_e4m3fn with block-wise scales `<name>_scale_inv` (float32, [ceil(out/b), ceil(in/b)]; weight ~= fp8 *
scale_inv per block), as in Qwen's and DeepSeek's FP8 releases; config.json gets the matching
`quantization_config` (quant_method fp8, weight_block_size). Everything else - embeddings, norms, lm_head,
routers, gates, convolutions - is stored bf16. Used by tests (tiny FP8 targets, made locally) and by users who
want an FP8 copy of their own target.
"""

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from specdistill.core.fp8 import is_quantized_name, quantize_blockwise
from specdistill.launch.command import common_flags, start

def make_fp8(src: Path, dst: Path, block: int = 128) -> Path:
    src, dst = Path(src), Path(dst)
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{src}: no *.safetensors files to quantize")
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():  # tokenizer, generation config, ...
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy2(f, dst / f.name)
    weight_map = {}
    for file in files:
        out = {}
        for name, t in load_file(str(file)).items():
            if t.ndim == 2 and is_quantized_name(name):
                out[name], out[f"{name}_scale_inv"] = quantize_blockwise(t, block)
            else:
                out[name] = t.to(torch.bfloat16) if t.is_floating_point() else t
        save_file(out, str(dst / file.name), metadata={"format": "pt"})
        weight_map.update({name: file.name for name in out})
    if len(files) > 1:
        (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [block, block]}
    config["torch_dtype"] = config["dtype"] = "bfloat16"
    if "text_config" in config:
        config["text_config"]["dtype"] = "bfloat16"
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return dst


def main() -> None:
    parser = common_flags(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    parser.add_argument("src", type=Path)
    parser.add_argument("dst", type=Path)
    parser.add_argument("--block", type=int, default=128, help="weight block size (square)")
    args = start(parser.parse_args())
    print(make_fp8(args.src, args.dst, args.block))


if __name__ == "__main__":
    main()
