"""Running the main job as users do (`specdistill-train ...`) from a test: the small settings most tests
share, and a run that fails the test with the output's tail."""

import os
import sys
from pathlib import Path

from tests.processes import run_bounded

REPO = Path(__file__).resolve().parents[1]
SMALL = ["drafter=dflash", "drafter.num_layers=1", "data.rows=12", "data.heldout_rows=4", "data.prompt_tokens=100",
         "data.max_new_tokens=16", "trainer.token_budget=1024", "trainer.checkpoint_every=2", "trainer.log_every=1",
         "trainer.progress=false", "feature_server.stall_timeout_s=120", "feature_server.load_timeout_s=300"]


def run_train(args, cache_dir):
    env = {**os.environ, "SPECDISTILL_CACHE": str(cache_dir)}
    proc = run_bounded([sys.executable, "-m", "specdistill.launch.train", *args], cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc
