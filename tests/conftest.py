"""Session-wide fixtures: tiny checkpoints built once per test session, never downloaded; and a guard that no
test module leaves a process running."""

import os

# As specdistill/launch/train.py does, before torch loads OpenMP: this process and everything it starts wait passively at
# OpenMP barriers, so tests' trainers, workers and engines sharing 2 cores do not spin against each other.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Runs' vLLM feature workers hold their engine in their own process (feature_server.engine_in_worker): ~25 s less
# per worker start on 2 cores. tests/test_production_shape.py keeps vLLM's own layout (docs/vllm.md).
os.environ.setdefault("SPECDISTILL_VLLM_ENGINE_IN_WORKER", "true")
# Likewise every served check (specdistill.evaluation.vllm_serve.serve): its engine in the pytest worker's engine host
# (one vLLM import for all its engines: ~20-35 s less per engine on 2 cores); tests/evaluation/test_vllm_serve.py
# serves in vLLM's own layout and compares.
os.environ.setdefault("SPECDISTILL_SERVE_OWN_PROCESS", "1")

import time  # noqa: E402
import uuid  # noqa: E402
import warnings  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

# Inherited by every process a test starts (subprocesses, vLLM engines, feature workers, Ray's raylet and its
# workers), so the guard below finds exactly this session's processes and no one else's.
# Under pytest-xdist (`make test` runs two workers) each worker is its own session: the mark names the worker too,
# so a worker's guard never takes the other worker's engines and runs for leftovers.
SESSION_MARK = "SPECDISTILL_TEST_SESSION"
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
_mark = os.environ.get(SESSION_MARK) or uuid.uuid4().hex
os.environ[SESSION_MARK] = _mark if not _WORKER or _mark.endswith(f"-{_WORKER}") else f"{_mark}-{_WORKER}"


def _session_processes(since: float) -> list:
    import psutil

    from specdistill.evaluation import engine_host

    mine, found = os.environ[SESSION_MARK], []
    for proc in psutil.process_iter(["pid", "create_time"]):
        if proc.pid == os.getpid() or proc.info["create_time"] < since:
            continue
        try:
            # multiprocessing's helpers and the served checks' engine host: reused all session
            session_helper = proc.pid == engine_host.host_pid() or proc.ppid() == os.getpid() and any(
                m in " ".join(proc.cmdline()) for m in ("resource_tracker", "forkserver"))
            if not session_helper and proc.environ().get(SESSION_MARK) == mine:
                found.append(proc)
        except psutil.Error:
            continue
    return found


# Seconds each of the longest modules takes in `make test` on the 2-core CI machine (pytest --durations, 2026-12-06):
# they start first, longest first, so neither worker ends the run alone on a long module.
MODULE_SECONDS = {
    "tests/test_e2e.py": 350, "tests/test_production_shape.py": 330, "tests/test_serving.py": 160,
    "tests/launch/test_ray_job.py": 110, "tests/test_many_drafters.py": 75, "tests/feature_server/test_server.py": 135,
    "tests/drafters/test_eagle3.py": 130, "tests/drafters/test_mtp.py": 120, "tests/launch/test_targets.py": 100,
    "tests/test_warm_start.py": 85, "tests/evaluation/test_vllm_serve.py": 80, "tests/test_wheel.py": 70,
    "tests/evaluation/test_offline_acceptance.py": 70, "tests/evaluation/test_lossless.py": 65,
    "tests/bench/test_pipeline_check.py": 60, "tests/bench/test_drafter_steps.py": 60,
    "tests/feature_server/test_vllm_backend.py": 60, "tests/launch/test_generate.py": 45,
    "tests/evaluation/test_turns.py": 40, "tests/trainer/test_parallel.py": 35, "tests/launch/test_sweep.py": 30,
}


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (`make test`: two workers, whole modules per worker) the longest modules go first, longest
    first (MODULE_SECONDS; the others by their vLLM and slow marks), so the run does not end with one worker on a long
    module while the other idles. Order inside a module is kept; the Makefile turns off xdist's own reorder."""
    if not _WORKER:
        return
    module_of = {item: item.nodeid.split("::")[0] for item in items}
    weight = dict.fromkeys(module_of.values(), 0)  # insertion order = collection order
    for item, module in module_of.items():
        marks = {m.name for m in item.iter_markers()}
        weight[module] += 2 * ("vllm" in marks) + ("slow" in marks)
    weight = {module: MODULE_SECONDS.get(module, w) for module, w in weight.items()}
    position = {module: i for i, module in enumerate(weight)}
    items.sort(key=lambda item: (-weight[module_of[item]], position[module_of[item]]))


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    """Every in-process computation of the suite is tiny (random 64-256-wide targets, drafters, references): two
    intra-op threads gain nothing on it, and on a 2-core machine shared with other jobs they wait on each other.
    Measured on such a machine: the EAGLE-3, DFlash 2 and DSpark learning tests took 93, 104 and 89 s with two
    threads, 0.7-0.9 s with one. Processes the tests start set their own threads (specdistill.launch.train, feature workers,
    vLLM engines, specdistill/launch/targets.py's fit, specdistill/launch/small_real.py's replay)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", autouse=True)
def no_process_left_behind():
    """Every process a test module starts ends with it. A leftover busy process once starved a later test in CI
    (Ray runs its workers at nice 15) into a 900 s timeout. Leftovers get 15 s to exit, then are killed and
    named in a warning (the end-of-run summary lists them)."""
    import psutil

    started = time.time()
    yield
    deadline = time.monotonic() + 15
    while (left := _session_processes(started)) and time.monotonic() < deadline:
        time.sleep(0.5)
    names = []
    for proc in left:
        try:
            names.append(f"{proc.pid}: {' '.join(proc.cmdline())[:160]}")
            proc.kill()
        except psutil.Error:
            continue
    if names:
        warnings.warn(f"{len(names)} process(es) outlived their test module and were killed: {names}")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """A random 4-layer Llama written with transformers (no tokenizer): for drafter-level tests."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=512)
    path = tmp_path_factory.mktemp("random-llama")
    LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    """One cache per test run: each tiny target and workload is built once, shared by all tests and, under
    pytest-xdist, by all workers (their base temp dirs share a parent; specdistill/core/build_lock.py makes the second
    worker wait for the first's build instead of fitting the same target again)."""
    if not _WORKER:
        return tmp_path_factory.mktemp("specdistill-cache")
    shared = tmp_path_factory.getbasetemp().parent / "specdistill-cache"
    shared.mkdir(exist_ok=True)
    return shared


@pytest.fixture(scope="session")
def tiny_target(cache_dir):
    """tiny_target(name) -> checkpoint dir of a named tiny target, built on first use."""
    from specdistill.launch.targets import ensure_target

    def build(name: str):
        return ensure_target(name, cache_dir / "targets")

    return build


@pytest.fixture(scope="session")
def target_alone_runs():
    """vLLM runs of a target alone, one engine per target and prompts for the whole session: shared by the served
    drafter tests (tests/serving_helpers.py TargetAloneRuns)."""
    from tests.serving_helpers import TargetAloneRuns

    return TargetAloneRuns()
