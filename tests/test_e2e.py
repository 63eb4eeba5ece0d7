"""The whole chain through the CLI contract: target -> workload -> features -> training -> export/metrics.

Runs `specdistill-train` as users do, then re-runs it with the same hydra.run.dir to check resume.
"""

import glob
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from specdistill.core.run_dir import RunDir
from tests.cli import REPO, SMALL, run_bounded, run_train


@pytest.mark.slow
@pytest.mark.parametrize("target", ["tiny-llama", pytest.param("tiny-qwen3-next", marks=pytest.mark.long)])
def test_cli_end_to_end_then_resume(tmp_path, cache_dir, tiny_target, target):
    """The run directory a user gets, then a resume; after each normal end nothing of the run is left in /dev/shm,
    semaphores included (the kill -9 case: test_a_kill_9_leaves_no_shared_memory_and_the_resume_is_bit_identical)."""
    tiny_target(target)  # built once per session, shared with the other tests
    run_dir = tmp_path / "run"
    run = RunDir(run_dir)
    args = [f"target={target}", *SMALL, f"hydra.run.dir={run_dir}"]
    semaphores_before = _semaphores()
    run_train([*args, "trainer.max_steps=3"], cache_dir)
    assert _run_files(run_dir) == []
    first = json.loads(run.metrics.read_text())
    for key in ("drafter", "steps", "train_tokens", "tau_offline", "per_position_acceptance",
                "feature_extraction_seconds", "training_seconds"):
        assert key in first, key
    assert first["drafter"] == "dflash" and first["steps"] == 3
    assert len(first["per_position_acceptance"]) == 7
    # tau is 1 + the accepted tokens per step. The export is the best point of a curve that starts at the untrained
    # drafter (step 0), chosen on the selection half of the held-out rows (re-walked there: the same tau); tau_offline
    # walks it on the other half, which the choice never saw (specdistill/trainer/validation.py).
    assert first["tau_offline"] == pytest.approx(1 + sum(first["per_position_acceptance"]))
    curve = first["heldout_curve"]
    assert [p["step"] for p in curve] == [0, 1, 2, 3] and first["export_selected"]["policy"] == "best"
    selected = next(p for p in curve if p["step"] == first["export_selected"]["step"])
    assert first["tau_offline_selection_rows"] == pytest.approx(selected["heldout_tau"]) == \
        max(p["heldout_tau"] for p in curve)
    split = first["heldout_split"]
    assert split["split"] and split["selection_rows"] + split["report_rows"] >= 2
    by_stage = first["acceptance_by_stage"]  # workload stages of the held-out rows; drafts add up to the total
    assert by_stage and sum(s["num_drafts"] for s in by_stage.values()) == first["heldout_drafts"]
    assert (run.export / "config.json").is_file() and (run.export / "model.safetensors").is_file()
    info = json.loads(run.run_info.read_text())
    assert info["config"]["drafter"]["name"] == "dflash" and "torch" in info["versions"]

    second = run_train([*args, "trainer.max_steps=5"], cache_dir)
    assert "resumed from" in second.stderr + second.stdout
    # the changed setting is said, and kept in run_info.json (whose config is now the resumed launch's)
    assert "setting changed from the run's own (run_info.json): trainer.max_steps: ran 3, asked 5" in second.stderr + second.stdout
    assert json.loads(run.run_info.read_text())["changed_on_resume"] == ["trainer.max_steps: ran 3, asked 5"]
    resumed = json.loads(run.metrics.read_text())
    assert resumed["steps"] == 5 and resumed["train_tokens"] > first["train_tokens"]
    assert _run_files(run_dir) == [] and _orphaned_semaphores(semaphores_before) == set()
    if target == "tiny-llama":  # a run directory past the asked steps is refused, not exported as a shorter run
        env = {**os.environ, "SPECDISTILL_CACHE": str(cache_dir)}
        third = run_bounded([sys.executable, "-m", "specdistill.launch.train", *args, "trainer.max_steps=4"], cwd=REPO, env=env)
        assert third.returncode != 0
        assert "already trained to step 5, past trainer.max_steps=4" in third.stderr + third.stdout
        assert json.loads(run.metrics.read_text())["steps"] == 5  # the finished run's record is untouched


@pytest.mark.slow
def test_run_survives_a_killed_feature_worker_with_nothing_lost_or_twice(tmp_path, cache_dir, tiny_target):
    """kill -9 one of two feature workers mid-run: its rows are reissued, the run finishes, and metrics.json
    counts 0 samples lost and 0 duplicated over the completed epochs."""
    import psutil

    tiny_target("tiny-llama")
    run_dir = tmp_path / "kill"
    env = {**os.environ, "SPECDISTILL_CACHE": str(cache_dir), "OMP_NUM_THREADS": "1"}
    args = [a for a in SMALL if not a.startswith(("data.rows", "trainer.token_budget"))]
    cmd = [sys.executable, "-m", "specdistill.launch.train", "target=tiny-llama", *args, "data.rows=24", "trainer.token_budget=256",
           "trainer.max_steps=30", "trainer.checkpoint_every=100", "feature_server.workers=2",
           f"hydra.run.dir={run_dir}"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        log = RunDir(run_dir).train_log
        deadline = time.monotonic() + 600
        while not (log.is_file() and log.read_text().count("\n") >= 2):  # training, mid-epoch
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()[-5000:]
            time.sleep(0.2)
        workers = [c for c in psutil.Process(proc.pid).children() if "spawn_main" in " ".join(c.cmdline())]
        assert len(workers) == 2, [c.cmdline() for c in workers]
        workers[0].kill()
        out, _ = proc.communicate(timeout=900)
    finally:
        proc.kill()
    assert proc.returncode == 0, out[-5000:]
    assert "exited with code -9" in out
    metrics = json.loads(RunDir(run_dir).metrics.read_text())
    assert metrics["steps"] == 30 and metrics["epochs_completed"] >= 1
    assert metrics["samples_lost"] == 0 and metrics["samples_duplicated"] == 0
    assert metrics["feature_workers_died"] == 1


def _run_files(run_dir: Path) -> list[str]:
    """The /dev/shm files and dirs of this run (trainer.py names them specdistill_<hash of run dir>_r<rank>-*)."""
    import hashlib

    key = hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:10]
    return sorted(f for f in os.listdir("/dev/shm") if f.startswith(f"specdistill_{key}_"))


def _semaphores() -> set[str]:
    """Named POSIX semaphores (multiprocessing's sem.mp-*, anyone's): a run must not add any that outlive it."""
    return {f for f in os.listdir("/dev/shm") if f.startswith("sem.")}


def _mapped_shm_inodes() -> set[int]:
    """Inodes of /dev/shm files some live process maps. A semaphore no process maps is orphaned: its users are gone.
    Live ones (another test worker's engines running meanwhile) are mapped by their processes. By inode, not name:
    glibc's sem_open creates under a temporary name and links it to sem.mp-* afterwards, so the creating process
    maps it as `/dev/shm/sem.XXXXXX (deleted)`."""
    found = set()
    for maps in glob.glob("/proc/[0-9]*/maps"):
        try:
            with open(maps) as f:
                found.update(int(line.split()[4]) for line in f if "/dev/shm/" in line)
        except OSError:  # the process ended while we looked
            continue
    return found


def _orphaned_semaphores(before: set[str]) -> set[str]:
    """New semaphores no live process maps, seen so twice a second apart (one whose owner is exiting meanwhile is
    unmapped a moment before the resource tracker unlinks it)."""
    def unmapped() -> set[str]:
        names = _semaphores() - before  # listed before the maps are read: a listed name is mapped by then
        mapped = _mapped_shm_inodes()
        found = set()
        for name in names:
            try:
                if os.stat(os.path.join("/dev/shm", name)).st_ino not in mapped:
                    found.add(name)
            except FileNotFoundError:  # its owner unlinked it while we looked
                continue
        return found

    first = unmapped()
    if not first:
        return first
    time.sleep(1.0)
    return first & unmapped()


@pytest.mark.slow
def test_epochs_share_one_server_and_a_resume_at_an_epoch_boundary_loses_nothing(tmp_path, cache_dir, tiny_target):
    """One feature server per run: three epochs load the target once per worker. A run stopped right after an
    epoch's last step (its end not yet counted) resumes at the boundary: 0 lost, 0 twice, the epochs complete."""
    tiny_target("tiny-llama")
    args = [a for a in SMALL if not a.startswith(("trainer.token_budget", "trainer.checkpoint_every"))]
    args = ["target=tiny-llama", *args, "trainer.token_budget=256", "trainer.checkpoint_every=100",
            "trainer.eval_every=0"]
    one_epoch = tmp_path / "one-epoch"  # one worker: rows arrive in dataset order, so every epoch packs alike
    run_train([*args, "trainer.max_epochs=1", "trainer.max_steps=1000", f"hydra.run.dir={one_epoch}"], cache_dir)
    per_epoch = json.loads(RunDir(one_epoch).metrics.read_text())["steps"]

    run_dir = tmp_path / "boundary"
    run_train([*args, f"trainer.max_steps={per_epoch}", f"hydra.run.dir={run_dir}"], cache_dir)
    at_boundary = json.loads(RunDir(run_dir).metrics.read_text())
    assert at_boundary["epochs_completed"] == 0 and at_boundary["engine_loads_per_worker"] == 1
    run_train([*args, "trainer.max_steps=1000", "trainer.max_epochs=3", f"hydra.run.dir={run_dir}"], cache_dir)
    metrics = json.loads(RunDir(run_dir).metrics.read_text())
    assert metrics["steps"] == 3 * per_epoch and metrics["epochs_completed"] == 3
    assert metrics["samples_lost"] == 0 and metrics["samples_duplicated"] == 0
    assert metrics["engine_loads_per_worker"] == 1  # the resumed process: epochs 1 and 2 on one load
    assert metrics["feature_workers_died"] == 0


@pytest.mark.slow
def test_a_kill_9_leaves_no_shared_memory_and_the_resume_is_bit_identical(tmp_path, cache_dir, tiny_target):
    """kill -9 the run's whole process group mid-run (no handler, no atexit, no finally: as a scheduler or an OOM
    killer ends a job), resume from its last checkpoint:
    - nothing of the run stays in /dev/shm, semaphores included, after the kill nor after the resumed run ends (after
      a normal end: test_cli_end_to_end_then_resume); before one server per run, each such kill left 4 semaphores (a
      worker's task Queue and the channel's wake-up);
    - the final weights equal, bit for bit, those of a run never interrupted (model, Muon + AdamW states, LR
      schedule, RNG, data position all restored), and the run files are private to the user."""
    import psutil

    tiny_target("tiny-llama")
    env = {**os.environ, "SPECDISTILL_CACHE": str(cache_dir), "OMP_NUM_THREADS": "1"}
    args = [a for a in SMALL if not a.startswith(("trainer.token_budget", "trainer.checkpoint_every", "data.rows"))]
    args = ["target=tiny-llama", *args, "data.rows=16", "trainer.token_budget=256", "trainer.max_steps=10",
            "trainer.checkpoint_every=1", "trainer.eval_rows=1"]
    straight = tmp_path / "straight"
    run_train([*args, f"hydra.run.dir={straight}"], cache_dir)

    semaphores_before = _semaphores()
    resumed = tmp_path / "resumed"
    cmd = [sys.executable, "-m", "specdistill.launch.train", *args, f"hydra.run.dir={resumed}"]
    # Its own process group, killed whole (multiprocessing's resource tracker too, which would otherwise unlink
    # leaked semaphores once the trainer is gone).
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while not RunDir(resumed).checkpoint(4).is_file():  # mid-run: the worker extracting ahead of the step
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
        workers = psutil.Process(proc.pid).children(recursive=True)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(60)
        psutil.wait_procs(workers, timeout=60)  # they die with it (PR_SET_PDEATHSIG) and sweep on the way out
    finally:
        proc.kill()
    assert all(not w.is_running() or w.status() == psutil.STATUS_ZOMBIE for w in workers)
    assert not RunDir(resumed).metrics.exists()  # it really died mid-run
    assert _run_files(resumed) == []
    second = run_train([*args, f"hydra.run.dir={resumed}"], cache_dir)
    assert "resumed from" in second.stdout + second.stderr
    assert _run_files(resumed) == [] and _orphaned_semaphores(semaphores_before) == set()
    a, b = (load_file(RunDir(d).export / "model.safetensors") for d in (straight, resumed))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    m_a, m_b = (json.loads(RunDir(d).metrics.read_text()) for d in (straight, resumed))
    assert m_a["final_loss"] == m_b["final_loss"] and m_a["train_tokens"] == m_b["train_tokens"]
    assert m_b["epochs_completed"] == m_a["epochs_completed"] and m_b["samples_lost"] == m_b["samples_duplicated"] == 0
    # Run files are private to the user (specdistill.launch.train sets umask 077).
    run = RunDir(resumed)
    for path in [run.metrics, run.export / "model.safetensors", *run.checkpoint_files()]:
        assert path.stat().st_mode & 0o777 == 0o600, path


# One row per pack (token_budget below two rows), every anchor used (no sampling): each step sees the same data
# whether one rank accumulates two packs or two ranks take one each.
RANKS_ARGS = ["target=tiny-llama", *(a for a in SMALL if not a.startswith(("trainer.token_budget", "data.rows"))),
              "data.rows=16", "trainer.token_budget=200", "drafter.max_anchors=512", "trainer.max_steps=4",
              "trainer.device=cpu", "trainer.eval_rows=1"]
TWO_RANKS = ["trainer.ranks=2", "feature_server.workers=2"]


@pytest.mark.slow
def test_two_ranks_and_one_rank_with_the_same_global_batch_take_the_same_steps(tmp_path, cache_dir, tiny_target):
    """DDP and FSDP2 (2 ranks x 1 pack, gradients averaged) vs 1 rank x 2 packs accumulated, on the same rows per
    step (RANKS_ARGS). The logged loss (mean over ranks) must agree step by step; only float summation order differs
    (gloo's all-reduce / reduce-scatter vs accumulation). Tolerance: 1e-4 relative for DDP (seen: bit-identical at
    this size), 1e-3 for FSDP (seen: 8.2e-5). The DDP run is plain `specdistill-train trainer.ranks=2`: it starts
    the ranks itself with torchrun's environment, each rank streams its own shard from its own worker, rank 0 writes
    the run directory, and while it runs no process of the run listens off loopback (torchrun's own store would
    listen on every interface)."""
    from tests.listeners import SampledRun, off_loopback_listeners

    tiny_target("tiny-llama")
    one, two, fsdp = (tmp_path / name for name in ("one", "two", "fsdp"))
    run_train([*RANKS_ARGS, "trainer.grad_accum=2", f"hydra.run.dir={one}"], cache_dir)
    env = {**os.environ, "SPECDISTILL_CACHE": str(cache_dir)}
    cmd = [sys.executable, "-m", "specdistill.launch.train", *RANKS_ARGS, *TWO_RANKS, f"hydra.run.dir={two}"]
    ddp = SampledRun(cmd, cwd=REPO, env=env, sample=lambda proc: off_loopback_listeners(roots=(proc.pid,)),
                     deadline_s=600, every_s=0.5)
    code, out = ddp.finish()
    assert code == 0, out[-6000:]
    started = r"started 2 trainer ranks \(pids \d+,\d+\); rendezvous store at 127\.0\.0\.1:\d+"
    assert re.search(started, out), out[-3000:]
    assert not ddp.found, f"listening off loopback: {ddp.found}"
    assert (RunDir(two).export / "model.safetensors").is_file()
    run_train([*RANKS_ARGS, *TWO_RANKS, "trainer.parallel=fsdp", f"hydra.run.dir={fsdp}"], cache_dir)
    logs = [[r for r in map(json.loads, RunDir(d).train_log.read_text().splitlines()) if "loss" in r]
            for d in (one, two, fsdp)]  # training records; the held-out points are records of their own
    assert [r["step"] for r in logs[0]] == [r["step"] for r in logs[1]] == [r["step"] for r in logs[2]] == [1, 2, 3, 4]
    for a, b, c in zip(*logs):
        # FSDP: its reduce-scatter and sharded grad-norm sum in another order (fp32 ulps), and Muon's bf16
        # Newton-Schulz turns ulps into bf16 roundings; seen: 8.2e-5 relative by step 3. Hence 1e-3 there.
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4) and a["loss"] == pytest.approx(c["loss"], rel=1e-3), \
            (a, b, c)
    m_one, m_two, m_fsdp = (json.loads(RunDir(d).metrics.read_text()) for d in (one, two, fsdp))
    assert m_one["final_loss"] == pytest.approx(m_two["final_loss"], rel=1e-4)
    assert m_one["train_tokens"] == m_two["train_tokens"] == m_fsdp["train_tokens"]  # summed over the ranks
    assert m_fsdp["samples_lost"] == m_fsdp["samples_duplicated"] == 0


@pytest.mark.slow
@pytest.mark.long  # tests/trainer/test_parallel.py resumes two FSDP ranks exactly; this is the same through the CLI
def test_two_fsdp_ranks_stopped_and_resumed_end_as_the_uninterrupted_run(tmp_path, cache_dir, tiny_target):
    """An FSDP run stopped at step 2 and resumed ends bit-identical to the uninterrupted one: gathered weights and
    optimizer states, and each rank's data position and RNG."""
    tiny_target("tiny-llama")
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    fsdp = [*TWO_RANKS, "trainer.parallel=fsdp"]
    run_train([*RANKS_ARGS, *fsdp, f"hydra.run.dir={whole}"], cache_dir)
    stopped = [a for a in RANKS_ARGS if a != "trainer.max_steps=4"]
    run_train([*stopped, *fsdp, "trainer.max_steps=2", f"hydra.run.dir={resumed}"], cache_dir)
    second = run_train([*RANKS_ARGS, *fsdp, f"hydra.run.dir={resumed}"], cache_dir)
    assert "resumed from" in second.stdout + second.stderr
    a, b = (load_file(RunDir(d).export / "model.safetensors") for d in (whole, resumed))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
@pytest.mark.parametrize("parallel, grad_accum, steps", [("ddp", 1, 7), ("fsdp", 2, 4)])
def test_ranks_with_uneven_shards_stop_together(parallel, grad_accum, steps, tmp_path, cache_dir, tiny_target):
    """15 rows over 2 ranks, one row per pack, one epoch: rank 0 has 8 packs, rank 1 has 7. One pack a step: both
    stop after step 7 (a rank alone in the gradient all-reduce would wait until collective_timeout_s and fail).
    Two packs a step: step 4 is two packs on rank 0 and one on rank 1, which repeats it at weight 0 so that both
    make the same collectives (FSDP gathers on every forward). Then the curve (one point, at step 0) ends before
    the last step: every rank walks the final weights with rank 0 (under FSDP, a gather)."""
    tiny_target("tiny-llama")
    args = [a for a in SMALL if not a.startswith(("trainer.token_budget", "data.rows"))]
    run_dir = tmp_path / "uneven"
    run_train(["target=tiny-llama", *args, "data.rows=15", "trainer.token_budget=200", "trainer.max_epochs=1",
               "trainer.max_steps=100", "trainer.device=cpu", "trainer.eval_rows=1", "trainer.ranks=2",
               "feature_server.workers=2", "trainer.collective_timeout_s=120", f"trainer.parallel={parallel}",
               f"trainer.grad_accum={grad_accum}", f"hydra.run.dir={run_dir}"], cache_dir)
    metrics = json.loads(RunDir(run_dir).metrics.read_text())
    assert metrics["steps"] == steps and metrics["samples_lost"] == metrics["samples_duplicated"] == 0
    assert metrics["packs"] == (15 if grad_accum == 2 else 14)  # one pack a step: rank 0's 8th is never trained
    assert metrics["heldout_curve"][-1]["step"] == steps


@pytest.mark.slow
def test_fp8_states_train_on_the_same_packs_for_about_half_the_bytes(tmp_path, cache_dir, tiny_target):
    """feature_server.hidden_dtype=float8_e4m3fn against the default bf16, same seed and rows: the same packs, a
    final loss within e4m3's noise, a held-out walk, and (D + 4) / 2D of the bytes per response token (1 byte a
    value and a 4-byte scale per position and layer, against 2 bytes a value)."""
    target_dir = tiny_target("tiny-llama")
    hidden = json.loads((target_dir / "config.json").read_text())["hidden_size"]
    metrics = {}
    for dtype in ("bfloat16", "float8_e4m3fn"):
        run_dir = tmp_path / dtype
        run_train(["target=tiny-llama", *SMALL, "trainer.max_steps=2", f"feature_server.hidden_dtype={dtype}",
                   f"hydra.run.dir={run_dir}"], cache_dir)
        metrics[dtype] = json.loads(RunDir(run_dir).metrics.read_text())
    bf16, fp8 = metrics["bfloat16"], metrics["float8_e4m3fn"]
    for key in ("packs", "train_tokens", "train_response_tokens", "rows_per_pack"):
        assert fp8[key] == bf16[key], key
    assert fp8["feature_bytes_per_response_token"] == pytest.approx(
        bf16["feature_bytes_per_response_token"] * (hidden + 4) / (2 * hidden), rel=1e-9)
    assert fp8["final_loss"] == pytest.approx(bf16["final_loss"], rel=0.1)
    assert fp8["heldout_drafts"] > 0 and fp8["tau_offline"] == pytest.approx(1 + sum(fp8["per_position_acceptance"]))
