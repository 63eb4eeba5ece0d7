"""specdistill/launch/ray_job.py for real: `ray job submit` of a 2-rank tiny run to a local Ray cluster on 127.0.0.1 (one
node with 2 ranks via `ray start`; two raylets with 1 rank each via ray.cluster_utils), one gloo process group,
a finished run dir; and, while it runs, no Ray or trainer process listening off loopback."""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from specdistill.core.run_dir import RunDir
from specdistill.launch.config import DataConfig
from specdistill.launch.prepare import resolve_data
from tests.listeners import SampledRun, off_loopback_listeners
from tests.cli import REPO, SMALL

pytest.importorskip("ray", reason="needs the test extra: pip install 'ray[default]'")
from omegaconf import OmegaConf  # noqa: E402

from specdistill.launch.ranks import torchrun_env  # noqa: E402
from specdistill.launch.ray_job import Node, NodeBundles, compose_run, pick_nodes, resolve_run_dir, visible_devices  # noqa: E402

RAY = str(Path(sys.executable).with_name("ray"))


def _layout(trainer_device="cpu", worker_device="cpu", node_gpus=0, ranks=2, workers=6, share=False) -> NodeBundles:
    """The production node's shape by default: 2 trainer ranks + 6 feature workers (3 per rank)."""
    cfg = OmegaConf.create({"trainer": {"device": trainer_device, "ranks": ranks},
                            "feature_server": {"device": worker_device, "workers": workers, "threads_per_worker": 2,
                                               "share_trainer_device": share}})
    return NodeBundles.from_config(cfg, node_gpus)


def test_cpu_layout_packs_ranks_then_workers_on_one_node():
    bundles = _layout().bundles()
    assert bundles[:2] == [{"CPU": 1.0}, {"CPU": 1.0}]  # local ranks 0, 1
    assert bundles[2:] == [{"CPU": 2.0}] * 6  # 6 workers, threads_per_worker CPUs each


def test_nodes_without_room_are_passed_over():
    layout = _layout(trainer_device="cuda", worker_device="cuda", node_gpus=8)
    head = Node("h", "10.0.0.1", 0, {"CPU": 64.0})  # a CPU-only head
    gpu_nodes = [Node(f"n{i}", f"10.0.0.{i + 2}", 8, {"CPU": 64.0, "GPU": 8.0}) for i in range(2)]
    assert pick_nodes([head, *gpu_nodes], layout, None) == gpu_nodes
    with pytest.raises(ValueError, match="--nodes 3: 2 of 3 alive node"):
        pick_nodes([head, *gpu_nodes], layout, 3)


def test_gpu_layout_orders_devices_like_torchrun():
    layout = _layout(trainer_device="auto", worker_device="cuda", node_gpus=8)
    assert layout.trainer_bundle == {"CPU": 1.0, "GPU": 1.0} and layout.worker_bundle == {"CPU": 2.0, "GPU": 1.0}
    bundle_gpus = [["5"], ["2"], ["0"], ["1"], ["3"], ["4"], ["6"], ["7"]]  # what Ray handed each bundle
    assert visible_devices(bundle_gpus, layout) == "5,2,0,1,3,4,6,7"  # cuda:LOCAL_RANK = the rank's own GPU
    from specdistill.trainer.layout import plan_node  # what each rank then plans over those 8 visible devices

    plan = plan_node(2, 6, "auto", "cuda", cuda_devices=8)
    assert plan.trainer_devices == ("cuda:0", "cuda:1") and plan.worker_devices[1] == ("cuda:5", "cuda:6", "cuda:7")


def test_workers_sharing_the_trainers_gpu_reserve_no_gpu_of_their_own():
    """layout=gpu1 on Ray: the rank's bundle holds the one GPU, its worker's bundle CPUs only."""
    layout = _layout(trainer_device="cuda", worker_device="cuda", node_gpus=1, ranks=1, workers=1, share=True)
    assert layout.bundles() == [{"CPU": 1.0, "GPU": 1.0}, {"CPU": 2.0}]
    assert visible_devices([["3"], []], layout) == "3"


def test_gpus_asked_of_a_cpu_cluster_fail_clearly():
    with pytest.raises(RuntimeError, match=r"Ray cluster \(at most 0 GPUs per node\): node layout needs 2 CUDA"):
        _layout(trainer_device="cuda")


def test_env_is_torchruns(monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    env = torchrun_env(rank=3, local_rank=1, node_rank=1, nodes=2, ranks_per_node=2, master=("10.0.0.1", 29400),
                       run_id="job")
    assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK")} == \
        {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1"}
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("10.0.0.1", "29400")
    assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True" and "GLOO_SOCKET_IFNAME" not in env  # not loopback
    assert torchrun_env(0, 0, 0, 1, 2, ("127.0.0.1", 1), "job")["GLOO_SOCKET_IFNAME"] == "lo"


def test_relative_run_dir_is_refused():
    with pytest.raises(ValueError, match="hydra.run.dir=outputs/.* is relative"):
        resolve_run_dir(compose_run(["drafter=dflash"]))
    assert resolve_run_dir(compose_run(["hydra.run.dir=/shared/r"])) == Path("/shared/r")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Two raylets on this machine, 2 logical CPUs each (1 trainer-rank bundle + 1 feature-worker bundle).
TWO_NODES = """
import signal, sys, time
from ray.cluster_utils import Cluster
head = dict(num_cpus=2, num_gpus=0, object_store_memory={mem}, include_dashboard=True, dashboard_host="127.0.0.1",
            dashboard_port={port}, temp_dir="{temp}")
cluster = Cluster(initialize_head=True, head_node_args=head)
cluster.add_node(num_cpus=2, num_gpus=0, object_store_memory={mem})
cluster.wait_for_nodes()
signal.signal(signal.SIGTERM, lambda *_: (cluster.shutdown(), sys.exit(0)))
print("ready", flush=True)
while True:
    time.sleep(1)
"""


# one-node runs in `make test-all` only: two-nodes runs the same job script across raylets, and two ranks of one node
# (their bundles, local ranks 0 and 1 in torchrun's environment) are the unit checks above.
@pytest.fixture(scope="module", params=[pytest.param("one-node", marks=pytest.mark.long), "two-nodes"])
def ray_head(request):
    """A Ray cluster bound to 127.0.0.1. RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 is Ray's local-only mode: without it
    Ray swaps 127.0.0.1 for the host's routable address and its GCS/raylet listen on all interfaces.
    one-node: `ray start --head`, 4 logical CPUs = 2 trainer-rank bundles + 2 feature-worker bundles (Ray's
    accounting; the machine has 2 cores). two-nodes: two raylets (ray.cluster_utils), 1 rank + 1 worker each."""
    root = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's unix socket paths must fit 107 bytes
    temp_dir = os.path.join(root, "ray")  # = RAY_TMPDIR/ray, where ray.cluster_utils writes its address file
    os.makedirs(temp_dir)
    port, mem = _free_port(), 100 * 2**20
    # RAY_worker_niceness=0: Ray runs its workers (and so the trainer ranks) at nice 15 by default; on 2 shared
    # cores any busy process then starves them, and a 1-minute job took over 10 minutes next to 2 busy loops.
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "RAY_TMPDIR": root,
           "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0", "RAY_worker_niceness": "0"}
    cluster = None
    try:
        if request.param == "one-node":
            start = [RAY, "start", "--head", "--node-ip-address", "127.0.0.1", "--dashboard-host", "127.0.0.1",
                     "--port", str(_free_port()), "--dashboard-port", str(port), "--num-cpus", "4", "--num-gpus",
                     "0", "--object-store-memory", str(mem), "--temp-dir", temp_dir, "--disable-usage-stats"]
            proc = subprocess.run(start, env=env, capture_output=True, text=True, timeout=180)
            assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        else:
            script = TWO_NODES.format(mem=mem, port=port, temp=temp_dir)
            cluster = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, text=True)
            assert cluster.stdout.readline().strip() == "ready", "two-node Ray cluster did not start"
        _wait_for_http(f"http://127.0.0.1:{port}/api/version")
        yield request.param, f"http://127.0.0.1:{port}", env, temp_dir
    finally:
        if cluster is not None:
            cluster.send_signal(signal.SIGTERM)
            cluster.wait(timeout=120)
        subprocess.run([RAY, "stop", "--force"], env=env, capture_output=True, timeout=120)
        shutil.rmtree(root, ignore_errors=True)


def _wait_for_http(url: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1)


def submit(ray_head, cache_dir, overrides: list[str], deadline_s: float = 600) -> tuple[int, str, set]:
    """`ray job submit` (blocking, logs streamed back) of specdistill.launch.ray_job; samples listeners while it runs. Past
    `deadline_s` the job is stopped (`ray job stop`, which frees its placement group for the next test) and its
    output so far is returned with code -1, so a hang fails with the job's own log instead of a bare timeout."""
    _, address, env, temp_dir = ray_head
    runtime_env = {"env_vars": {"SPECDISTILL_CACHE": str(cache_dir)}}
    cmd = [RAY, "job", "submit", "--address", address, "--working-dir", ".",
           "--runtime-env-json", json.dumps(runtime_env), "--", sys.executable, "-m", "specdistill.launch.ray_job", *overrides]
    marks = (temp_dir, *(o for o in overrides if o.startswith("hydra.run.dir=")))
    job = SampledRun(cmd, cwd=REPO, env=env, sample=lambda _: off_loopback_listeners(marks), deadline_s=deadline_s,
                     every_s=1.0)
    if not job.running:
        return *job.finish(), job.found
    job_id = next(iter(re.findall(r"Job '(raysubmit_\w+)' submitted", "".join(job.lines))), None)
    if job_id:
        subprocess.run([RAY, "job", "stop", "--address", address, job_id], env=env, capture_output=True, timeout=120)
    _, out = job.finish()
    return -1, out + f"\n[test] job {job_id} still running after {deadline_s:.0f} s: stopped\n", job.found


# A rank stuck in a collective fails after 300 s (naming the collective) rather than hanging the job.
TINY = ["target=tiny-llama", *SMALL, "trainer.max_steps=2", "trainer.device=cpu", "trainer.collective_timeout_s=300"]
PER_NODE = {"one-node": ["trainer.ranks=2", "feature_server.workers=2"],  # 2 ranks in all, either way,
            "two-nodes": ["trainer.ranks=1", "feature_server.workers=1"]}  # each with one feature worker


@pytest.mark.slow
@pytest.mark.timeout(1200)  # above submit()'s 600 s deadline, so a hang still reports the job's log
def test_ray_job_two_ranks_one_process_group(ray_head, tmp_path, cache_dir, tiny_target):
    shape = ray_head[0]
    target_dir = tiny_target("tiny-llama")
    # Built once here, so the two ranks do not race to write the same synthetic workload.
    resolve_data(DataConfig(rows=12, heldout_rows=4, prompt_tokens=100, max_new_tokens=16), target_dir, cache_dir)
    run_dir = tmp_path / "ray-run"
    code, out, listeners = submit(ray_head, cache_dir, [*TINY, *PER_NODE[shape], f"hydra.run.dir={run_dir}"])
    assert code == 0, out[-6000:]
    assert not listeners, f"listening off loopback: {listeners}"

    # WORLD_SIZE=2: rank 0 blocks in init_process_group until rank 1 joins, and DDP syncs every step, so a
    # finished run means both ranks were in one gloo group (two-nodes: across the two raylets).
    placed = re.findall(r"rank (\d)/2: node (\d) \(127\.0\.0\.1, id (\w+)\) local rank (\d)", out)
    if shape == "one-node":
        assert [(r, n, lr) for r, n, _, lr in placed] == [("0", "0", "0"), ("1", "0", "1")], out[-3000:]
    else:
        assert [(r, n, lr) for r, n, _, lr in placed] == [("0", "0", "0"), ("1", "1", "0")], out[-3000:]
        assert placed[0][2] != placed[1][2]  # two different raylets
    metrics = json.loads(RunDir(run_dir).metrics.read_text())
    assert metrics["steps"] == 2 and (RunDir(run_dir).export / "model.safetensors").is_file()


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("ray_head", ["two-nodes"], indirect=True)  # the failure path does not depend on the shape
def test_ray_job_failing_ranks_fail_the_job(ray_head, tmp_path, cache_dir):
    """Both ranks exit non-zero (no checkpoint at target.path): the job fails and says which ranks."""
    code, out, _ = submit(ray_head, cache_dir, [*TINY, *PER_NODE["two-nodes"], f"target.path={tmp_path / 'missing'}",
                                                f"hydra.run.dir={tmp_path / 'run'}"])
    assert code != 0 and "trainer ranks failed (rank: exit code)" in out and "no config.json there" in out, out[-4000:]
