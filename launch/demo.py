"""`make demo`: the whole chain on the default target (tiny-qwen3-next), sized for 2 CPU cores.

Builds the tiny target and the synthetic workload (cached), trains DFlash with online features,
exports it in speculators format and prints where the export is, tau on held-out rows and the time
split. It runs the real CLI, so what it prints is what `python -m launch.train` produces.
"""

import json
import subprocess
import sys
import time
from pathlib import Path

RUN_DIR = Path("outputs/demo")
# The embedded default (conf/config.yaml) with a drafter sized for 2 cores: the production DFlash
# (5 layers, 1024 anchors, 4096-token packs) takes tens of seconds per step there.
OVERRIDES = ["drafter=dflash", "target=tiny-qwen3-next", "drafter.num_layers=2", "drafter.max_anchors=256",
             "trainer.token_budget=2048", "trainer.max_steps=60", f"hydra.run.dir={RUN_DIR}"]


def main() -> int:
    started = time.perf_counter()
    cmd = [sys.executable, "-m", "launch.train", *OVERRIDES, *sys.argv[1:]]
    print("+", " ".join(cmd), flush=True)
    if subprocess.call(cmd) != 0:
        return 1
    m = json.loads((RUN_DIR / "metrics.json").read_text())
    wall = time.perf_counter() - started
    print(f"\nexport: {Path(m['export_dir']).resolve()}")
    print(f"tau_offline (held-out, {m['heldout_drafts']} drafts, K={m['num_speculative_tokens']}): {m['tau_offline']:.3f}")
    print("per_position_acceptance: " + " ".join(f"{a:.2f}" for a in m["per_position_acceptance"]))
    print(f"time: feature extraction {m['feature_extraction_seconds']:.1f} s (worker-side), "
          f"training {m['training_seconds']:.1f} s, waiting for features {m['feature_wait_seconds']:.1f} s, "
          f"wall {wall:.1f} s (incl. target/data build on a fresh cache)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
