#!/usr/bin/env bash
# GPU check (one H200, under 8 minutes): drafter steps at production shapes first, then the kernels' tests and
# benchmarks, then what needs vLLM or speculators where they are installed (the lent GPU image has neither).
#   bash bench/gpu_check.sh            (from the repo root; PY=python3 by default, .venv/bin/python if present)
# Needs only torch (CUDA), transformers, safetensors, numpy, psutil, pytest: every stage runs on the image as is.
# A stage that fails or runs past its timeout is reported and the next one runs; the exit status is non-zero if
# any failed. Each stage prints its own figures; docs/gpu.md records the last run's.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
export PYTHONUNBUFFERED=1
failed=()
stage() {  # stage NAME SECONDS CMD...: run CMD under a timeout, record a failure, go on
    local name=$1 limit=$2; shift 2
    echo "==== $name (limit ${limit} s)"
    local t0=$SECONDS
    timeout "$limit" "$@"
    local rc=$?
    echo "==== $name: rc=$rc in $((SECONDS - t0)) s"
    [ "$rc" -eq 0 ] || failed+=("$name(rc=$rc)")
}
has() { "$PY" -c "import $1" 2>/dev/null; }

"$PY" - <<'PY' || exit 1
import torch
assert torch.cuda.is_available(), "gpu_check.sh needs a CUDA device"
print(torch.__version__, torch.cuda.get_device_name(0))
PY

# Every drafter's train step on the mission's 32k pack, Qwen3.5-35B-A3B geometry (hidden 2048, vocab 248,320),
# bf16 autocast, compiled flex attention, grouped MoE (MTP): step time, tokens/s, peak memory, TFLOP/s, MFU.
stage drafter_steps 300 "$PY" bench/drafter_steps.py --device cuda --steps 3 --warmup 1
# Values and gradients of every kernel path, the gpu-marked flex tests included (they skip on CPU).
stage kernel_tests 120 "$PY" -m pytest -q tests/kernels -m "gpu or not gpu" -p no:cacheprovider
# Grouped MoE vs transformers (4096 tokens), response-only logits memory, compiled flex vs dense SDPA (4k/16k packs).
stage kernels_bench 150 "$PY" bench/kernels.py --device cuda --reps 5
# layout=node (2 trainer + 6 worker GPUs) on one GPU must fail naming the device count.
stage layout_error 30 "$PY" - <<'PY'
from specdistill.trainer.layout import plan_node, cuda_device_count
try:
    plan_node(2, 6, "cuda", "cuda", cuda_device_count())
    raise SystemExit("layout=node on one GPU did not fail")
except RuntimeError as err:
    print("layout error ok:", str(err)[:160])
PY

if has vllm; then
    # DSpark and DFlash 2 served by vLLM's Model Runner V2 (CPU's V1 rejects both): random exports serve losslessly.
    VLLM_USE_V2_MODEL_RUNNER=1 stage vllm_serves_dspark_dflash2 300 "$PY" -m pytest -q tests/drafters/test_dspark.py \
        tests/drafters/test_dflash2.py -m gpu -p no:cacheprovider
    # A tiny FP8 target extracted by the vLLM backend on CUDA matches the HF backend's dequantized states.
    stage fp8_vllm_extraction 300 "$PY" - <<'PY'
import tempfile
from pathlib import Path
from specdistill.launch.targets import make_target
from specdistill.launch.make_fp8 import make_fp8
from specdistill.core.contract import FeatureSpec, TokenizedRow
from specdistill.feature_server.backends import build_backend
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
    stage extraction_batching 300 "$PY" bench/extraction_batching.py
else
    echo "==== skipped (vllm not installed): vLLM serving of DSpark/DFlash 2, FP8 extraction, extraction batching"
fi
if has speculators; then
    stage transport 120 "$PY" bench/transport.py --samples 10 --reps 2
else
    echo "==== skipped (speculators not installed): bench/transport.py (its file-backend reference needs it)"
fi

if [ ${#failed[@]} -gt 0 ]; then
    echo "gpu_check: FAILED: ${failed[*]}"
    exit 1
fi
echo "gpu_check: all stages passed"
