"""Starting trainer ranks the way torchrun does, with the rendezvous store bound to one address.

torchrun's own store (torch.distributed.TCPStore) listens on every interface of the machine, whatever
MASTER_ADDR says. Here the launcher binds the socket itself (127.0.0.1 on one node; the node's address under
Ray) and hosts the store on it, as torchrun's agent hosts its store: the ranks get torchrun's environment with
TORCHELASTIC_USE_AGENT_STORE=True, so they join as clients and nothing else listens. gloo and NCCL bootstrap
on loopback too when every rank is on this machine (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME, unless set).

Used by `specdistill-train trainer.ranks=N` (launch_local) and by specdistill/launch/ray_job.py (Store,
torchrun_env, die_with_parent). Plain `torchrun ... -m specdistill.launch.train` keeps working; it binds as torchrun does.
"""

import datetime
import logging
import os
import signal
import socket
import subprocess
import sys
import time

log = logging.getLogger("specdistill.ranks")
LOOPBACK = "127.0.0.1"


class Store:
    """A TCPStore served from a socket bound to `ip` only; lives as long as this object."""

    def __init__(self, ip: str, world_size: int, timeout_s: float = 1800):
        import torch.distributed as dist

        self._sock = socket.create_server((ip, 0))
        self.address = (ip, self._sock.getsockname()[1])
        self._store = dist.TCPStore(ip, self.address[1], world_size, is_master=True, wait_for_workers=False,
                                    master_listen_fd=self._sock.fileno(),
                                    timeout=datetime.timedelta(seconds=timeout_s))


def torchrun_env(rank: int, local_rank: int, node_rank: int, nodes: int, ranks_per_node: int, master: tuple,
                 run_id: str) -> dict:
    """The variables torchrun sets for a worker (specdistill/trainer/distributed.py reads RANK, WORLD_SIZE, LOCAL_RANK)."""
    world = nodes * ranks_per_node
    env = {"RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(world),
           "LOCAL_WORLD_SIZE": str(ranks_per_node), "GROUP_RANK": str(node_rank), "GROUP_WORLD_SIZE": str(nodes),
           "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(world), "MASTER_ADDR": master[0],
           "MASTER_PORT": str(master[1]), "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RUN_ID": run_id}
    if master[0].startswith("127."):  # every rank on this machine: the collectives' own sockets on loopback too
        for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            if name not in os.environ:
                env[name] = "lo"
    return env


def die_with_parent() -> None:
    """preexec_fn: the child gets SIGTERM when its parent dies (kill -9 of the launcher included)."""
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


def launch_local(ranks: int, args: list[str], poll_s: float = 0.5) -> int:
    """Run `specdistill-train ARGS` as `ranks` ranks on this node; the first rank to fail stops the others
    (a lone rank would wait in a collective). Returns 0, or the first failing rank's exit code."""
    store = Store(LOOPBACK, ranks)
    run_id = f"local-{os.getpid()}"
    procs = []
    for rank in range(ranks):
        env = {**os.environ, **torchrun_env(rank, rank, 0, 1, ranks, store.address, run_id)}
        procs.append(subprocess.Popen([sys.executable, "-m", "specdistill.launch.train", *args], env=env,
                                      preexec_fn=die_with_parent))
    log.info("started %d trainer ranks (pids %s); rendezvous store at %s:%d", ranks,
             ",".join(str(p.pid) for p in procs), *store.address)
    forwarded = _forward_signals(procs)
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
            if failed or all(code == 0 for code in codes):
                break
            time.sleep(poll_s)
    finally:
        _stop(procs)
        for sig, handler in forwarded.items():
            signal.signal(sig, handler)
    if failed:
        log.error("trainer rank %d exited with code %d; stopped the others (exit codes by rank: %s)",
                  failed[0][0], failed[0][1], [p.returncode for p in procs])
        return failed[0][1]
    return 0


def _forward_signals(procs) -> dict:
    """SIGTERM / SIGINT to the launcher (preemption, Ctrl-C) go on to every rank; returns the old handlers."""
    def forward(sig, _frame):
        for p in procs:
            if p.poll() is None:
                p.send_signal(sig)

    return {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}


def _stop(procs, grace_s: float = 30) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
