"""bench/pipeline_check.py, gpu_check.sh's first stage, runs where CI does (CPU), so it cannot rot unseen: a run killed
with SIGKILL after a checkpoint resumes from it and finishes with nothing lost, and its export reads back bit-equal to
the weights the run selected. The CUDA command is the CPU one but for the layout, and docs/gpu.md holds the CPU
reference and the tolerance the GPU figure is judged by."""

import os
import sys

import pytest

from tests.cli import REPO
from tests.processes import run_bounded


def test_the_gpu_command_is_the_cpu_reference_but_for_the_layout(tmp_path):
    from bench.pipeline_check import LAYOUT, overrides
    from specdistill.launch.config import compose_config

    cuda, cpu = (overrides(d, 200, 100, tmp_path, []) for d in ("cuda", "cpu"))
    assert [o for o in cuda if o not in LAYOUT["cuda"]] == [o for o in cpu if o not in LAYOUT["cpu"]]
    cfg = compose_config([o for o in cuda if not o.startswith("hydra.")])
    assert cfg.feature_server.share_trainer_device and cfg.trainer.device == "cuda"
    run = (cfg.drafter.name, cfg.target.name, cfg.trainer.max_steps, cfg.trainer.seed)
    assert run == ("eagle3", "small-real", 200, 0)


def test_docs_record_the_cpu_reference_and_the_tolerance():
    from bench.pipeline_check import DOC, TOLERANCE, cpu_reference

    assert cpu_reference() is not None, f"{DOC}: no 'pipeline_cpu_heldout_tau: X' line"
    assert f"tolerance {TOLERANCE}" in DOC.read_text()


# Two trainer launches on small-real, each starting a worker: 35 s on 2 idle cores, 140 s beside a training run.
@pytest.mark.slow
def test_a_killed_run_resumes_and_its_export_reads_back(tmp_path):
    env = {**os.environ, "SPECDISTILL_CACHE": str(tmp_path / "cache")}
    cmd = [sys.executable, "bench/pipeline_check.py", "--device", "cpu", "--steps", "8", "--kill-at", "4",
           "--run-dir", str(tmp_path / "run"), "trainer.token_budget=1024", "trainer.eval_rows=4"]
    out = run_bounded(cmd, cwd=REPO, env=env, timeout_s=600)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    values = dict(line.split(": ", 1) for line in out.stdout.splitlines() if ": " in line and not line.startswith(" "))
    assert values["resumed_from_step"] == "4"
    assert "bit-equal to the selected weights" in values["export_read_back"]
    assert values["samples_lost"] == "0, samples_duplicated: 0"
    assert float(values["pipeline_heldout_tau"]) >= 1.0 and float(values["pipeline_fed_step_ms"]) > 0
    assert values["pipeline_steps"].startswith("8 ")
