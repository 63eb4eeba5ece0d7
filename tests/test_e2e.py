"""The whole chain through the CLI contract: target -> workload -> features -> training -> export/metrics.

Runs `python -m launch.train` as users do, then re-runs it with the same hydra.run.dir to check resume.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SMALL = ["drafter=dflash", "drafter.num_layers=1", "data.rows=12", "data.heldout_rows=4", "data.prompt_tokens=100",
         "data.max_new_tokens=16", "trainer.token_budget=1024", "trainer.checkpoint_every=2", "trainer.log_every=1",
         "trainer.progress=false"]


def run_train(args, cache_dir):
    env = {**os.environ, "SPECDISTILL_CACHE": str(cache_dir)}
    proc = subprocess.run([sys.executable, "-m", "launch.train", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


@pytest.mark.slow
@pytest.mark.parametrize("target", ["tiny-llama", "tiny-qwen3-next"])
def test_cli_end_to_end_then_resume(tmp_path, cache_dir, tiny_target, target):
    tiny_target(target)  # built once per session, shared with the other tests
    run_dir = tmp_path / "run"
    args = [f"target={target}", *SMALL, f"hydra.run.dir={run_dir}"]
    run_train([*args, "trainer.max_steps=3"], cache_dir)
    first = json.loads((run_dir / "metrics.json").read_text())
    for key in ("drafter", "steps", "train_tokens", "tau_offline", "per_position_acceptance",
                "feature_extraction_seconds", "training_seconds"):
        assert key in first, key
    assert first["drafter"] == "dflash" and first["steps"] == 3
    assert 1.0 <= first["tau_offline"] <= 8.0 and len(first["per_position_acceptance"]) == 7
    assert (run_dir / "export" / "config.json").is_file() and (run_dir / "export" / "model.safetensors").is_file()
    info = json.loads((run_dir / "run_info.json").read_text())
    assert info["config"]["drafter"]["name"] == "dflash" and "torch" in info["versions"]

    second = run_train([*args, "trainer.max_steps=5"], cache_dir)
    assert "resumed from" in second.stderr + second.stdout
    resumed = json.loads((run_dir / "metrics.json").read_text())
    assert resumed["steps"] == 5 and resumed["train_tokens"] > first["train_tokens"]


@pytest.mark.slow
def test_torchrun_two_ranks_on_cpu(tmp_path, cache_dir, tiny_target):
    """DDP over gloo: each rank streams its own shard; rank 0 writes the run directory."""
    tiny_target("tiny-llama")
    run_dir = tmp_path / "ddp"
    env = {**os.environ, "SPECDISTILL_CACHE": str(cache_dir), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29517",
           "-m", "launch.train", "target=tiny-llama", *SMALL, "trainer.max_steps=2", "trainer.device=cpu",
           f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["steps"] == 2 and (run_dir / "export" / "model.safetensors").is_file()
