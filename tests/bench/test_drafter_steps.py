"""bench/drafter_steps.py runs where CI does (CPU, --small), so the GPU check's first stage cannot rot unseen: every
drafter builds at the bench's target geometry, takes the trainer's step under bf16 autocast and reports its speed."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_drafter_steps_and_reports_under_bf16_autocast():
    out = subprocess.run([sys.executable, "bench/drafter_steps.py", "--small", "--device", "cpu", "--precision",
                          "bf16", "--warmup", "0", "--steps", "1", "--count-flops"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    values = dict(line.split(": ") for line in out.stdout.splitlines() if line.count(": ") == 1 and "_" in line)
    for name in ("mtp", "eagle3", "dflash", "dspark", "dflash2"):
        assert float(values[f"{name}_tokens_per_s"]) > 0
        assert float(values[f"{name}_tflops"]) > 0  # FlopCounterMode saw the step's matmuls
