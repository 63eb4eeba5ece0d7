"""Soak run (not a test): `python bench/soak.py [--minutes 30] [--every 15]`.

Runs `specdistill-train` at tiny scale (tiny-llama, 2 feature workers, a shared-memory capacity of a few
packs, so the workers spend most of their time blocked on backpressure) for a bounded time, sampling every
--every seconds: the RSS of the trainer and of each feature worker, and the machine's shared memory in use
(/proc/meminfo Shmem: the rings are unlinked once mapped, so they show there and not as files) and the shared
memory this run's processes have mapped (their /proc/PID/maps entries of the run's /dev/shm names, which other
jobs on the machine do not move). One feature server serves the whole run: its workers load the target once and
stream epoch after epoch, so they live as long as the run, and a leak in them shows as growth of their summed RSS
across the epochs, as a leak in the trainer does in its own. Then it stops the run with SIGTERM (a clean shutdown)
and checks that no file of the run is left in /dev/shm.

Prints the curve (one line per sample), then last ("growth" = the last quarter's mean minus the second
quarter's; the first quarter is warm-up):
  trainer_rss_growth_mb: X
  worker_rss_growth_mb: X        the live feature workers' summed RSS
  workers_started: N             feature worker processes seen (2 unless one died and was replaced)
  run_shm_growth_mb: X           shared memory mapped by the run's processes
  shm_growth_mb: X               the machine's Shmem
  leftover_shm_files: N
"""

import argparse
import hashlib
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from specdistill.core.run_dir import RunDir  # noqa: E402


def shmem_mb() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("Shmem:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def feature_workers(trainer: psutil.Process) -> list[psutil.Process]:
    """The trainer's spawned feature workers alive now (one that is exiting is skipped)."""
    found = []
    for child in trainer.children(recursive=True):
        try:
            if "spawn_main" in " ".join(child.cmdline()):
                found.append(child)
        except psutil.Error:
            continue
    return found


def run_shm_mb(procs, marker: str) -> float:
    """Shared memory mapped by `procs` from files whose name holds `marker`, each file counted once."""
    sizes: dict[str, int] = {}
    for proc in procs:
        try:
            lines = Path(f"/proc/{proc.pid}/maps").read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            if marker not in line:
                continue
            fields = line.split()
            start, end = (int(x, 16) for x in fields[0].split("-"))
            inode = fields[4]
            sizes[inode] = max(sizes.get(inode, 0), end - start)
    return sum(sizes.values()) / 2**20


def growth(values: list[float]) -> float:
    q = max(1, len(values) // 4)
    return statistics.mean(values[-q:]) - statistics.mean(values[q: 2 * q])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30)
    parser.add_argument("--every", type=float, default=15)
    parser.add_argument("--cache-dir", default=str(REPO / ".cache/specdistill"))
    args = parser.parse_args()
    run_dir = Path(tempfile.mkdtemp(prefix="soak-")) / "run"
    cmd = [sys.executable, "-m", "specdistill.launch.train", "target=tiny-llama", "drafter=dflash", "drafter.num_layers=1",
           "data.rows=48", "data.heldout_rows=4", "data.prompt_tokens=100", "data.max_new_tokens=16",
           "trainer.token_budget=256", "trainer.max_steps=100000000", "trainer.max_epochs=100000000",
           "trainer.checkpoint_every=200",
           "trainer.log_every=50", "trainer.progress=false", "feature_server.workers=2",
           "feature_server.capacity_mb=2", f"hydra.run.dir={run_dir}"]
    env = {**os.environ, "SPECDISTILL_CACHE": args.cache_dir, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    trainer = psutil.Process(proc.pid)
    key = hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:10]
    marker = f"/dev/shm/specdistill_{key}_"
    rows, seen, t0 = [], set(), time.monotonic()  # seen: every feature worker pid
    print("t_s  trainer_rss_mb  workers  worker_rss_mb  run_shm_mb  shmem_mb  steps")
    try:
        while time.monotonic() - t0 < args.minutes * 60:
            time.sleep(args.every)
            if proc.poll() is not None:
                raise SystemExit(f"the run died (exit {proc.returncode}):\n{proc.stderr.read()[-3000:]}")
            workers = feature_workers(trainer)
            now, worker_rss = time.monotonic() - t0, 0.0
            for w in workers:
                try:
                    worker_rss += w.memory_info().rss / 2**20
                except psutil.Error:
                    continue
                seen.add(w.pid)
            log = RunDir(run_dir).train_log
            steps = log.read_text().count('"loss"') * 50 if log.is_file() else 0  # training records
            rows.append((now, trainer.memory_info().rss / 2**20, len(workers), worker_rss,
                         run_shm_mb([trainer, *workers], marker), shmem_mb(), steps))
            print("%5.0f  %14.1f  %7d  %13.1f  %10.1f  %8.1f  %5d" % rows[-1], flush=True)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
    leftovers = [f for f in os.listdir("/dev/shm") if f.startswith(f"specdistill_{key}_")]
    print(f"trainer_rss_growth_mb: {growth([r[1] for r in rows]):.1f}")
    print(f"worker_rss_growth_mb: {growth([r[3] for r in rows]):.1f}")
    print(f"workers_started: {len(seen)}")
    print(f"run_shm_growth_mb: {growth([r[4] for r in rows]):.1f}")
    print(f"shm_growth_mb: {growth([r[5] for r in rows]):.1f}")
    print(f"leftover_shm_files: {len(leftovers)}")


if __name__ == "__main__":
    main()
