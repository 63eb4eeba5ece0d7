"""Many nodes through Ray: the same training entry as specdistill.launch.train, one torch process group across nodes.

    ray job submit --address http://HEAD:8265 --working-dir . -- \\
        python -m specdistill.launch.ray_job [--nodes N] hydra.run.dir=/shared/runs/x drafter=dflash target.path=/models/t ...

Per node, one placement group (STRICT_PACK, pinned to that node) reserves what specdistill/trainer/layout.py plans for a
node (layout=node: 2 trainer ranks + 6 feature workers): a bundle per trainer rank (trainer.ranks; 1 GPU, or 1
CPU) and one per feature worker (feature_server.workers per node, split over the ranks; 1 GPU when they run on
cuda, threads_per_worker CPUs). A TrainerRank actor in each rank bundle starts
`specdistill-train` with the environment torchrun would give it (RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR/PORT), so specdistill/trainer/distributed.py forms one process group over all
nodes (gloo on CPU, nccl on GPU) and each rank spawns its own feature workers on its own node: hidden states
cross only node-local shared memory; only gradients cross nodes. Rank 0's actor hosts the rendezvous store, as
torchrun's agent does (TORCHELASTIC_USE_AGENT_STORE), bound to its node's address only.

The run dir must be absolute and, across nodes, on storage every node shares (rank 0 writes it, every rank
reads its checkpoints on resume); Ray's --working-dir is a per-node temporary copy.
"""

import argparse
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import ray
from omegaconf import DictConfig
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from specdistill.launch.command import common_flags, start
from specdistill.launch.config import compose_config
from specdistill.launch.ranks import Store, die_with_parent, torchrun_env
from specdistill.trainer.layout import plan_node

log = logging.getLogger("specdistill.ray_job")
_POLL_S = 2.0
_ACTOR_TIMEOUT_S = 300.0  # starting an actor or a call on it; a stuck cluster fails the job instead of hanging it


def _get(refs, what: str, timeout_s: float = _ACTOR_TIMEOUT_S):
    """ray.get with a deadline that names what was awaited."""
    try:
        return ray.get(refs, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise RuntimeError(f"Ray did not answer within {timeout_s:.0f} s while {what}; see `ray status` and this "
                           "job's logs (a worker that cannot start, or a node that went away)") from None


@dataclass(frozen=True)
class NodeBundles:
    """What Ray reserves on one node for specdistill/trainer/layout.py's plan: a bundle per trainer rank, then one per feature
    worker (feature_server.workers per node, workers // ranks per rank, rank-major)."""

    ranks: int
    workers: int
    trainer_bundle: dict
    worker_bundle: dict

    @classmethod
    def from_config(cls, cfg: DictConfig, node_gpus: int) -> "NodeBundles":
        t, fs = cfg.trainer, cfg.feature_server
        try:  # the same plan (and checks) each rank makes again on its node
            plan = plan_node(t.ranks, fs.workers, t.device, fs.device, node_gpus, fs.share_trainer_device)
        except RuntimeError as err:
            raise RuntimeError(f"Ray cluster (at most {node_gpus} GPUs per node): {err}") from None
        trainer_bundle = {"CPU": 1.0, "GPU": 1.0} if plan.trainer_devices[0].startswith("cuda") else {"CPU": 1.0}
        worker_bundle = {"CPU": float(fs.threads_per_worker)}
        if plan.worker_devices[0][0].startswith("cuda") and not fs.share_trainer_device:  # shared: the rank's GPU
            worker_bundle["GPU"] = 1.0
        return cls(plan.ranks, plan.workers, trainer_bundle, worker_bundle)

    @property
    def uses_gpu(self) -> bool:
        return "GPU" in self.trainer_bundle or "GPU" in self.worker_bundle

    def bundles(self) -> list[dict]:
        """Trainer ranks first (bundle i = local rank i), then the workers, rank-major."""
        return [dict(self.trainer_bundle) for _ in range(self.ranks)] + \
            [dict(self.worker_bundle) for _ in range(self.workers)]


def visible_devices(bundle_gpus: list[list[str]], layout: NodeBundles) -> str:
    """All of the node's reserved GPUs in bundle order, the order specdistill/trainer/layout.py numbers them in: cuda:LOCAL_RANK
    is the rank's own GPU, worker i of local rank r gets cuda:(ranks + r * workers_per_rank + i)."""
    ordered = [g for gpus in bundle_gpus[:layout.ranks] for g in gpus]
    ordered += [g for gpus in bundle_gpus[layout.ranks:] for g in gpus]
    return ",".join(ordered)


@dataclass(frozen=True)
class Node:
    node_id: str
    ip: str
    gpus: int
    resources: dict


@ray.remote
def _bundle_info() -> tuple[str, list[str]]:
    return ray.get_runtime_context().get_node_id(), [str(g) for g in ray.get_gpu_ids()]


@ray.remote
class TrainerRank:
    """One trainer rank: a specdistill.launch.train process with torchrun's environment; rank 0 also hosts the store."""

    def __init__(self):
        self.proc: subprocess.Popen | None = None
        self.store: Store | None = None

    def host_store(self, world_size: int) -> tuple[str, int]:
        self.store = Store(ray.util.get_node_ip_address(), world_size)  # this node's address only
        return self.store.address

    def start(self, env: dict, args: list[str]) -> int:
        cmd = [sys.executable, "-m", "specdistill.launch.train", *args]
        # PR_SET_PDEATHSIG: the training process dies with this actor (ray.kill, node loss) instead of lingering.
        self.proc = subprocess.Popen(cmd, env={**os.environ, **env}, preexec_fn=die_with_parent)
        return self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()

    def stop(self) -> int | None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.poll() if self.proc else None


def compose_run(overrides: list[str]) -> DictConfig:
    """The config specdistill.launch.train will compose from the same overrides (strict: typos fail here, before any
    resources are reserved), with the hydra node, for the run dir."""
    return compose_config(overrides, return_hydra_config=True)


def resolve_run_dir(cfg: DictConfig) -> Path:
    run_dir = Path(str(cfg.hydra.run.dir)).expanduser()
    if not run_dir.is_absolute():
        raise ValueError(f"hydra.run.dir={run_dir} is relative: under `ray job submit` it would land in each node's "
                         "temporary copy of --working-dir. Pass hydra.run.dir=/shared/path/RUN (storage every node "
                         "mounts at the same path).")
    return run_dir


def alive_nodes() -> list[Node]:
    """The driver's node first (it hosts rank 0 when it can). By id, not IP: one machine may run several raylets."""
    here = ray.get_runtime_context().get_node_id()
    alive = sorted((n for n in ray.nodes() if n["Alive"]), key=lambda n: (n["NodeID"] != here, n["NodeID"]))
    return [Node(n["NodeID"], n["NodeManagerAddress"], int(n["Resources"].get("GPU", 0)), n["Resources"])
            for n in alive]


def pick_nodes(nodes: list[Node], layout: NodeBundles, count: int | None) -> list[Node]:
    """The first `count` nodes (default: all) with room for the whole layout; a CPU-only head is passed over."""
    need = {}
    for bundle in layout.bundles():
        for key, amount in bundle.items():
            need[key] = need.get(key, 0.0) + amount
    fit = [n for n in nodes if all(n.resources.get(k, 0.0) >= v for k, v in need.items())]
    count = len(fit) if count is None else count
    if not fit or count < 1 or count > len(fit):
        raise ValueError(f"--nodes {count}: {len(fit)} of {len(nodes)} alive node(s) can hold one node's layout "
                         f"({need}); their resources: {[(n.ip, n.resources) for n in nodes]}")
    return fit[:count]


def reserve(node: Node, layout: NodeBundles, timeout_s: float) -> PlacementGroup:
    bundles = layout.bundles()
    # Ray's built-in node-id label pins every bundle to this node; STRICT_PACK alone would pick any node.
    pg = placement_group(bundles, strategy="STRICT_PACK", name=f"specdistill-{node.node_id[:8]}",
                         bundle_label_selector=[{"ray.io/node-id": node.node_id}] * len(bundles))
    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(pg)
        free = next((n["Resources"] for n in ray.nodes() if n["NodeID"] == node.node_id), {})
        raise RuntimeError(f"node {node.ip} ({node.node_id[:8]}) could not hold {layout.ranks} trainer rank(s) x "
                           f"{layout.trainer_bundle} + {layout.workers} feature worker(s) x {layout.worker_bundle} "
                           f"within {timeout_s:.0f} s; the node has {free} (others may hold part of it). Lower "
                           "trainer.ranks / feature_server.workers, or give the node more (ray start --num-cpus "
                           "/--num-gpus).") from None
    return pg


def place(pg: PlacementGroup, index: int) -> PlacementGroupSchedulingStrategy:
    return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=index)


def probe(pg: PlacementGroup, node: Node, layout: NodeBundles) -> list[list[str]]:
    """GPU ids of every bundle (a bundle keeps its devices for its lifetime), checking each sits on `node`."""
    refs = [_bundle_info.options(num_cpus=0, num_gpus=b.get("GPU", 0), scheduling_strategy=place(pg, i)).remote()
            for i, b in enumerate(layout.bundles())]
    infos = _get(refs, f"probing the placement group on node {node.ip} ({node.node_id[:8]})")
    strays = [(i, node_id[:8]) for i, (node_id, _) in enumerate(infos) if node_id != node.node_id]
    if strays:
        raise RuntimeError(f"placement group for node {node.node_id[:8]} has bundles elsewhere: {strays}")
    return [gpus for _, gpus in infos]


def launch(nodes: list[Node], pgs: list[PlacementGroup], layout: NodeBundles, args: list[str], run_id: str) -> list:
    ranks, envs = [], []
    for node_rank, (node, pg) in enumerate(zip(nodes, pgs)):
        bundle_gpus = probe(pg, node, layout)
        devices = visible_devices(bundle_gpus, layout) if layout.uses_gpu else ""
        for local_rank in range(layout.ranks):
            bundle = layout.trainer_bundle
            actor = TrainerRank.options(num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0),
                                        scheduling_strategy=place(pg, local_rank)).remote()
            ranks.append(actor)
            envs.append((node_rank, local_rank, {"CUDA_VISIBLE_DEVICES": devices}))
    master = _get(ranks[0].host_store.remote(len(ranks)), "starting rank 0's actor (it hosts the rendezvous store)")
    for rank, (actor, (node_rank, local_rank, env)) in enumerate(zip(ranks, envs)):
        env.update(torchrun_env(rank, local_rank, node_rank, len(nodes), layout.ranks, master, run_id))
        pid = _get(actor.start.remote(env, args), f"starting trainer rank {rank}")
        node = nodes[node_rank]
        log.info("rank %d/%s: node %d (%s, id %s) local rank %d, pid %d", rank, env["WORLD_SIZE"], node_rank,
                 node.ip, node.node_id[:8], local_rank, pid)
    log.info("started %d trainer rank(s) on %d node(s); rendezvous at %s:%d", len(ranks), len(nodes), *master)
    return ranks


def wait(ranks: list) -> list[int]:
    """Poll until every rank exits; the first failure stops the others (a lone rank would hang in a collective)."""
    codes: list[int | None] = [None] * len(ranks)
    while any(c is None for c in codes):
        time.sleep(_POLL_S)
        for i, c in enumerate(_get([r.poll.remote() for r in ranks], "polling the trainer ranks")):
            codes[i] = c
        if any(c not in (None, 0) for c in codes):
            codes = _get([r.stop.remote() for r in ranks], "stopping the trainer ranks")
            break
    return codes


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = common_flags(argparse.ArgumentParser(prog="specdistill-ray-job", description=__doc__.split("\n\n")[0]))
    parser.add_argument("--nodes", type=int, default=None, help="nodes to use (default: every alive node)")
    parser.add_argument("--reserve-timeout", type=float, default=300.0, help="seconds to wait for resources")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, exactly as for specdistill-train")
    return start(parser.parse_args(argv))


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s][%(name)s] %(message)s")
    opts = parse_args(sys.argv[1:] if argv is None else argv)
    cfg = compose_run(opts.overrides)
    run_dir = resolve_run_dir(cfg)
    # One dir for every rank: ${now:} would differ per process.
    args = [o for o in opts.overrides if not o.startswith("hydra.run.dir=")] + [f"hydra.run.dir={run_dir}"]
    ray.init(address=os.environ.get("RAY_ADDRESS", "auto"))
    alive = alive_nodes()
    layout = NodeBundles.from_config(cfg, node_gpus=max(n.gpus for n in alive))
    nodes = pick_nodes(alive, layout, opts.nodes)
    pgs, ranks = [], []
    try:
        pgs = [reserve(node, layout, opts.reserve_timeout) for node in nodes]
        ranks = launch(nodes, pgs, layout, args, run_id=ray.get_runtime_context().get_job_id())
        codes = wait(ranks)
    finally:
        for actor in ranks:  # their training processes have exited (or die with them: PR_SET_PDEATHSIG)
            ray.kill(actor)
        for pg in pgs:
            remove_placement_group(pg)
    failed = {rank: code for rank, code in enumerate(codes) if code != 0}
    if failed:
        log.error("trainer ranks failed (rank: exit code): %s; their output is in this job's logs", failed)
        return 1
    log.info("run dir: %s (metrics.json, export/)", run_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
