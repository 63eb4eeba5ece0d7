#!/usr/bin/env bash
# GPU check (one H100 or H200, under 5 minutes: GPU_CHECK_BUDGET_S): the whole training loop on this one GPU first
# (killed, resumed, its export read back, its held-out tau against the CPU figure), then the drafter steps at
# production shapes, the kernels' tests and benchmarks, then what needs vLLM or speculators where they are installed
# (the lent GPU image has neither). What each stage prints, its limits, the CPU reference: docs/gpu.md.
#   bash bench/gpu_wheels.sh           (here, where pip works: Hydra's wheels into .whl/, which the image lacks)
#   bash bench/gpu_check.sh            (on the GPU machine, from the repo root, .whl carried: the device tool's
#                                       run(command="bash bench/gpu_check.sh", carry=[".whl"]); PY=python3 by
#                                       default, .venv/bin/python if present)
# Needs torch (CUDA), transformers, safetensors, numpy, psutil, pyarrow, tqdm, pytest (all on the image) and, for the
# pipeline stage, hydra-core + omegaconf, installed from .whl/ below unless already importable.
# A stage that fails or runs past its limit is reported and the next one runs. Stages run in order of importance,
# each limited to what is left of GPU_CHECK_BUDGET_S (280 s), so the whole script ends within 5 minutes and a
# 15-minute device budget holds a machine's start and a second try; a stage left without time is reported as not run.
# The exit status is 1 if a stage failed, 3 if none failed but one was not run, 0 if all ran and passed.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
BUDGET=${GPU_CHECK_BUDGET_S:-280}  # + the last stage's 10 s kill grace: under 5 minutes
MIN_STAGE_S=15  # a stage is not started with less left than this
export PYTHONUNBUFFERED=1
failed=()
not_run=()
stage() {  # stage NAME SECONDS CMD...: run CMD under min(SECONDS, budget left), record a failure, go on
    local name=$1 limit=$2; shift 2
    local left=$((BUDGET - SECONDS))
    if [ "$left" -lt "$MIN_STAGE_S" ]; then
        echo "==== $name: not run (${left} s of the ${BUDGET} s budget left)"
        not_run+=("$name")
        return
    fi
    [ "$limit" -le "$left" ] || limit=$left
    echo "==== $name (limit ${limit} s, ${left} s of the budget left)"
    local t0=$SECONDS
    timeout -k 10 "$limit" "$@"
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

# Hydra and OmegaConf (and omegaconf's antlr4 runtime) are not on the GPU image: bench/gpu_wheels.sh builds their
# wheels into .whl/, the device tool carries it, and they are installed into a folder put on PYTHONPATH (the
# feature worker and the resumed launch inherit it; the image's own environment is left as it is). Already
# importable (a .venv, another image): nothing is installed.
if ! has hydra || ! has omegaconf; then
    site=${TMPDIR:-/tmp}/specdistill-gpu-site
    if compgen -G ".whl/*.whl" >/dev/null && "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
            --upgrade --target "$site" --find-links .whl hydra-core omegaconf antlr4-python3-runtime; then
        export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
        echo "installed $(cd .whl && echo *.whl) into $site (PYTHONPATH)"
    fi
fi

# The whole loop on this GPU (layout=gpu1: one trainer rank and one transformers-backend feature worker sharing the
# device): EAGLE-3 on small-real with the committed corpus rows, seed 0, 200 steps, kill -9 of the trainer after
# step 100's checkpoint, the same command resumed to step 200, the export read back bit-equal to the weights the run
# selected. Prints pipeline_heldout_tau beside pipeline_cpu_heldout_tau (the same command's fp32 CPU figure in
# docs/gpu.md; fails beyond its tolerance, 0.3) and pipeline_fed_step_ms (training_seconds / steps of the run).
if has hydra && has omegaconf; then
    stage pipeline 180 "$PY" bench/pipeline_check.py --device cuda
else
    echo "==== pipeline: not run: no hydra/omegaconf here and no wheels in .whl/ (bash bench/gpu_wheels.sh where pip" \
         "works, then carry .whl)"
    failed+=("pipeline(no hydra)")
fi
# layout=node (2 trainer + 6 worker GPUs) on one GPU must fail naming the device count and the one-GPU opt-in;
# layout=gpu1 (feature_server.share_trainer_device) plans the rank and its worker on cuda:0.
stage layout 15 "$PY" - <<'PY'
from specdistill.trainer.layout import plan_node, cuda_device_count
one = plan_node(1, 1, "cuda", "cuda", cuda_device_count(), share_trainer_device=True)
assert one.trainer_devices == ("cuda:0",) and one.worker_devices == (("cuda:0",),), one
try:
    plan_node(2, 6, "cuda", "cuda", cuda_device_count())
    raise SystemExit("layout=node on one GPU did not fail")
except RuntimeError as err:
    assert "share_trainer_device" in str(err), err
    print("layout error ok:", str(err)[:200])
PY
# The trainer's step of each of DRAFTERS (default eagle3,dflash: the pipeline's drafter and the default one; all five,
# each compiling its own attention, with GPU_CHECK_BUDGET_S raised) on the mission's 32k pack, Qwen3.5-35B-A3B geometry
# (hidden 2048, vocab 248,320), bf16 autocast, compiled flex attention: step time, tokens/s, peak memory, and with
# --fed the step fed as a run feeds it (synthetic producers -> rings -> feed -> device): {name}_fed_step_ms and
# {name}_mfu (analytic).
stage drafter_steps 90 "$PY" bench/drafter_steps.py --device cuda --fed --drafters "${DRAFTERS:-eagle3,dflash}" \
    --steps 3 --warmup 1
# Values and gradients of every kernel path, the gpu-marked flex tests included (they skip on CPU), and the pinned
# pack pool + side-stream copy (tests/trainer/test_device_copy.py).
stage kernel_tests 60 "$PY" -m pytest -q tests/kernels tests/trainer/test_device_copy.py -m "gpu or not gpu" -p no:cacheprovider
# The same fed steps as before issue 38 (whole rows shipped, every position computed): the before of drafter_steps'
# after, on the same card.
stage drafter_steps_before 60 "$PY" bench/drafter_steps.py --device cuda --fed --drafters "${DRAFTERS:-eagle3,dflash}" \
    --steps 3 --warmup 1 --positions all --compute all
# Grouped MoE vs transformers (4096 tokens), response-only logits memory, compiled flex vs dense SDPA (4k/16k packs).
stage kernels_bench 60 "$PY" bench/kernels.py --device cuda --reps 5

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

echo "gpu_check: ${SECONDS} s"
if [ ${#failed[@]} -gt 0 ]; then
    echo "gpu_check: FAILED: ${failed[*]}${not_run[*]:+; not run: ${not_run[*]}}"
    exit 1
fi
if [ ${#not_run[@]} -gt 0 ]; then
    echo "gpu_check: INCOMPLETE: passed what ran; not run (budget spent): ${not_run[*]}"
    exit 3
fi
echo "gpu_check: all stages passed"
