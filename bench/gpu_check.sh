#!/usr/bin/env bash
# GPU check for issue 4 (H200, a few minutes): kernel tests incl. the CUDA-only ones, then the benchmarks.
#   bash bench/gpu_check.sh            (from the repo root, venv with a CUDA torch active or at .venv)
# Prints, last, the same ratio lines as `python bench/kernels.py`; on CUDA the attention line is
# `attention_gpu_speedup` (compiled flex_attention vs the dense-mask SDPA reference, bf16).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python )}
"$PY" - <<'PY'
import torch
assert torch.cuda.is_available(), "gpu_check.sh needs a CUDA device"
print(torch.__version__, torch.cuda.get_device_name(0))
PY
# Values and gradients of every path, the gpu-marked flex tests included (they skip on CPU).
timeout 900 "$PY" -m pytest -q tests/kernels -m "gpu or not gpu" -p no:cacheprovider
# Full sizes: MoE 4096 tokens, 4k/16k packs; the first flex call per shape includes compilation (warm-up).
timeout 900 "$PY" bench/kernels.py --device cuda --reps 5

# ---- drafters issue 3: DSpark and DFlash 2 served by vLLM (Model Runner V2; CPU's V1 rejects both) ----------
# A random drafter of each, exported in speculators format against tiny-llama, must serve losslessly with drafts
# made (tests/drafters/test_dspark.py, test_dflash2.py: test_vllm_serves_export_losslessly; needs vllm>=0.32).
VLLM_USE_V2_MODEL_RUNNER=1 timeout 900 "$PY" -m pytest -q tests/drafters/test_dspark.py tests/drafters/test_dflash2.py \
    -m gpu -p no:cacheprovider
# ---- end drafters issue 3 --------------------------------------------------------------------------------

# ---- feature server issue 5: layout errors, FP8 target served quantized by vLLM, transport ------------------
# One H200: layout=node (8 GPUs) must fail with the device count; then a tiny FP8 target extracted by the vLLM
# backend on cuda must match the HF backend's dequantized states within bf16 + fp8 tolerance.
"$PY" - <<'PY'
import tempfile, torch
from pathlib import Path
from trainer.layout import plan_node, cuda_device_count
try:
    plan_node(2, 6, "cuda", "cuda", cuda_device_count())
    raise SystemExit("layout=node on one GPU did not fail")
except RuntimeError as err:
    print("layout error ok:", str(err)[:120])
from launch.targets import make_target
from launch.make_fp8 import make_fp8
from core.contract import FeatureSpec, TokenizedRow
from feature_server.backends import build_backend
with tempfile.TemporaryDirectory() as tmp:
    src = make_target("tiny-llama", Path(tmp) / "src", fit_steps=0)
    fp8 = make_fp8(src, Path(tmp) / "fp8", block=32)
    spec = FeatureSpec((1, 2, 3), "float32")
    row = TokenizedRow(0, tuple(range(3, 200)), (0,) * 150 + (1,) * 47)
    hf = build_backend("hf", str(fp8), spec, device="cuda", dtype="bfloat16").extract([row])[0]
    vl = build_backend("vllm", str(fp8), spec, device="cuda", dtype="bfloat16")
    got = vl.extract([row])[0]; vl.close()
    rel = ((got - hf).norm() / hf.norm()).item()
    print(f"fp8_vllm_vs_hf_rel_error: {rel:.4f}")
    assert rel < 0.05, rel
PY
timeout 600 "$PY" bench/transport.py --samples 10 --reps 2
# ---- end feature server issue 5 ----------------------------------------------------------------------------
