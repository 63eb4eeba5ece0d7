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
