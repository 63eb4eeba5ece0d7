#!/usr/bin/env bash
# The wheels bench/gpu_check.sh's pipeline stage needs and the GPU image lacks, built here into .whl/ (ignored:
# .gitignore) for the device tool to carry (docs/gpu.md):
#   bash bench/gpu_wheels.sh             (from the repo root, where pip reaches a package index; PY=.venv/bin/python)
# then run `bash bench/gpu_check.sh` on the GPU machine with carry=[".whl"]; gpu_check.sh installs them itself.
#
# The image (the device tool's KINDS.md, 2026-11-17) holds torch 2.11 (CUDA), transformers 5.17, and every other
# package specdistill imports at run time: safetensors, tokenizers, numpy, psutil, tqdm, pyarrow, accelerate,
# matplotlib, PyYAML, packaging, pytest. It lacks Hydra; these three pure-Python wheels, at the versions .venv has
# (the CPU reference in docs/gpu.md ran on them), are all that is carried (~0.4 MB):
#   hydra-core              specdistill.launch.train is a Hydra main (needs omegaconf, antlr4 4.9.*, packaging)
#   omegaconf               the composed config (needs antlr4 4.9.*, PyYAML)
#   antlr4-python3-runtime  omegaconf's interpolation grammar; PyPI has only its source archive: `pip wheel` builds it
# Not carried: vllm and speculators (the check runs the transformers backend; their stages skip), ray and wandb
# (optional extras the check does not use). One version of each wheel: .whl/ is emptied first, since two versions of
# one package stop the whole install.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
OUT=.whl
version() { "$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1"; }

mkdir -p "$OUT"
rm -f "$OUT"/*.whl
for name in hydra-core omegaconf; do
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d "$OUT" "$name==$(version "$name")"
done
"$PY" -m pip wheel -q --no-deps -w "$OUT" "antlr4-python3-runtime==$(version antlr4-python3-runtime)"

# Pure Python only (the image runs Python 3.12 on x86-64; these install anywhere), and what each one requires,
# which must be among the three or on the image (above).
"$PY" - "$OUT" <<'PY'
import sys
import zipfile
from pathlib import Path

wheels = sorted(Path(sys.argv[1]).glob("*.whl"))
assert len(wheels) == 3, f"expected 3 wheels, found {[w.name for w in wheels]}"
for wheel in wheels:
    assert wheel.name.endswith("-py3-none-any.whl"), f"{wheel.name}: not a pure-Python wheel"
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        needs = [line.split(":", 1)[1].strip() for line in z.read(meta).decode().splitlines()
                 if line.startswith("Requires-Dist:") and "extra ==" not in line]
    print(f"{wheel.name} ({wheel.stat().st_size // 1024} KiB) requires: {', '.join(needs) or 'nothing'}")
PY
echo "carry .whl: run(command='bash bench/gpu_check.sh', carry=['.whl'])"
