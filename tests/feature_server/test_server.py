"""FeatureServer with real spawned HF workers on a tiny random Llama: delivery, sharding, faults, errors, cleanup."""

import os
import re
import signal

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from specdistill.core.contract import FeatureSample, FeatureSpec, TokenizedRow
from specdistill.feature_server.config import FeatureServerConfig
from specdistill.feature_server.hf_backend import HFBackend
from specdistill.feature_server.ledger import FeatureWorkerError, shard_rows
from specdistill.feature_server.server import FeatureServer
from specdistill.feature_server.shm_transport import segment_paths
from tests.feature_server.rows import HIDDEN, LAYERS, SPEC, VOCAB, fp8_bound, make_rows


def cfg(**settings) -> FeatureServerConfig:
    """The run's feature_server settings with one worker on cpu unless given."""
    return FeatureServerConfig(**{"workers": 1, **settings})


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=16, intermediate_size=64, max_position_embeddings=128,
                         dtype="float32")
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return str(path)


def _prefix(request) -> str:
    return "sdtest_" + "".join(c if c.isalnum() else "_" for c in request.node.name)[-40:]


def test_two_workers_deliver_every_row_exactly_once(target, request):
    rows = make_rows(10)
    expected = {r.row_id: h for r, h in zip(rows, HFBackend(target, SPEC).extract(rows))}
    prefix = _prefix(request)
    with FeatureServer(target, SPEC, rows, cfg(workers=2), shm_prefix=prefix) as server:
        got = {}
        for sample in server:
            assert sample.row_id not in got, f"row {sample.row_id} delivered twice"
            got[sample.row_id] = sample
        stats = server.stats()
    assert set(got) == set(expected)
    for row in rows:  # same values as an in-process backend: nothing lost or reordered in the transport
        torch.testing.assert_close(got[row.row_id].hidden_TLD, expected[row.row_id], rtol=1e-5, atol=1e-5)
        assert got[row.row_id].input_ids_T.tolist() == list(row.input_ids)
    assert stats["samples"] == 10 and stats["tokens"] == sum(r.num_tokens for r in rows)
    assert stats["bytes"] > sum(h.numel() * 4 for h in expected.values())
    assert stats["workers_done"] == 2 and sum(s["samples"] for s in stats["per_worker"].values()) == 10
    assert all(s["samples"] > 0 for s in stats["per_worker"].values())  # both took rows from the queue
    assert (stats["rows_reissued"], stats["duplicates_dropped"], stats["rows_lost"]) == (0, 0, 0)
    assert 0 < stats["extract_wall_s_max"] <= stats["extract_wall_s_sum"]
    assert segment_paths(prefix) == []


def test_rank_shards_are_disjoint_and_complete_and_stable_under_skips(target):
    rows = make_rows(23)
    skip = frozenset(r.row_id for r in rows[::5])
    owned = [[r.row_id for r in FeatureServer(target, SPEC, rows, cfg(workers=2), rank=rank, num_ranks=3,
                                              skip_row_ids=skip).rows] for rank in range(3)]
    flat = [i for ids in owned for i in ids]
    assert len(flat) == len(set(flat)) and set(flat) == {r.row_id for r in rows} - skip
    # A resumed run (more rows skipped) keeps every remaining row on the same rank.
    resumed = FeatureServer(target, SPEC, rows, cfg(workers=2), rank=0, num_ranks=3,
                            skip_row_ids=skip | {rows[3].row_id})
    assert [r.row_id for r in resumed.rows] == [i for i in owned[0] if i != rows[3].row_id]


@pytest.mark.slow  # two spawned workers importing torch + transformers: ~15 s on 2 cores
def test_rank_sharding_is_disjoint_and_complete_and_skipsmake_rows(target, request):
    rows = make_rows(13)
    skip = frozenset(r.row_id for r in rows[::4])
    prefix = _prefix(request)
    # Both ranks' servers run at once, as under torchrun.
    servers = [FeatureServer(target, SPEC, rows, cfg(), rank=r, num_ranks=2, skip_row_ids=skip,
                             shm_prefix=f"{prefix}{r}")
               for r in range(2)]
    seen = []
    for server in servers:
        server.start()
    for server in servers:
        with server:
            seen.append({s.row_id for s in server})
            assert len(seen[-1]) == server.num_rows
    assert not seen[0] & seen[1]
    assert seen[0] | seen[1] == {r.row_id for r in rows} - skip
    # Skipping does not move rows between ranks: a resumed run keeps the same assignment.
    assert seen[0] == {r.row_id for r in shard_rows(rows, 0, 2)} - skip
    assert all(segment_paths(f"{prefix}{r}") == [] for r in range(2))


def test_worker_exception_names_worker_and_row_and_cleans_up(target, request):
    rows = make_rows(6)
    bad = TokenizedRow(rows[2].row_id, rows[2].input_ids[:-1] + (VOCAB + 3,), rows[2].loss_mask)
    rows[2] = bad
    prefix = _prefix(request)
    server = FeatureServer(target, SPEC, rows, cfg(), shm_prefix=prefix)
    # The worker names the batch it was prefilling; the backend's own error names the row.
    with pytest.raises(FeatureWorkerError, match=rf"worker 0 .*failed on rows \[.*{bad.row_id}.*\]:.*row {bad.row_id}: "
                                                 rf"token ids \[{VOCAB + 3}\] outside the target vocabulary") as err:
        for _ in server:
            pass
    assert "--- worker traceback ---" in str(err.value) and "check_row" in str(err.value)
    assert all(not p.is_alive() for p in server._procs.values())
    assert segment_paths(prefix) == []


def _named_semaphores_mapped_by(pid: int) -> list[str]:
    with open(f"/proc/{pid}/maps") as f:
        return [line.split(maxsplit=5)[-1].strip() for line in f if "/dev/shm/sem." in line]


def _consume_killing(server, kill_after: int = 1):
    """Iterate, kill -9 one live worker after `kill_after` samples; returns row ids in arrival order."""
    got = []
    for sample in server:
        got.append(sample.row_id)
        if len(got) == kill_after:
            os.kill(server.worker_pids()[0], signal.SIGKILL)
    return got


def test_killed_worker_without_restarts_raises_instead_of_hanging(target, request):
    rows = make_rows(30)
    prefix = _prefix(request)
    # Tiny capacity: one sample in flight at a time, so the worker cannot finish while we hold off.
    server = FeatureServer(target, SPEC, rows, cfg(capacity_mb=1e-6), shm_prefix=prefix, max_worker_restarts=0)
    with pytest.raises(FeatureWorkerError, match=r"worker 0 .*exited with code -9 without reporting.*no workers left"
                                                 r".*rows \[\d+"):
        _consume_killing(server)
    assert segment_paths(prefix) == []


@pytest.mark.slow  # three spawned workers: ~20 s on 2 cores
def test_killed_worker_rows_are_reissued_exactly_once(target, request):
    """kill -9 one of two workers mid-batch (rows of 3-7 tokens, 24-token batches: it has published part of a
    batch and holds the rest): its in-flight rows go to the other; every row arrives exactly once."""
    rows = make_rows(40)
    prefix = _prefix(request)
    server = FeatureServer(target, SPEC, rows, cfg(workers=2, capacity_mb=1e-6, batch_tokens=24), shm_prefix=prefix,
                           max_worker_restarts=0)
    dead = None
    got = []
    for sample in server:
        got.append(sample.row_id)
        if len(got) == 3:
            dead = min(server.worker_pids())
            # A named semaphore it maps (tqdm's default lock) would outlive the kill until the session's end.
            assert _named_semaphores_mapped_by(server.worker_pids()[dead]) == []
            os.kill(server.worker_pids()[dead], signal.SIGKILL)
    stats = server.stats()
    assert sorted(got) == sorted(r.row_id for r in rows)  # nothing lost, nothing twice
    assert stats["workers_died"] == 1 and stats["rows_reissued"] >= 1 and stats["rows_lost"] == 0
    assert stats["duplicates_dropped"] == 0 and stats["per_worker"][dead]["samples"] < 20
    assert segment_paths(prefix) == []

    # With restarts, even a single worker's death is survived: a replacement takes the rows over.
    server = FeatureServer(target, SPEC, rows[:12], cfg(capacity_mb=1e-6), shm_prefix=prefix, max_worker_restarts=1)
    got = _consume_killing(server, kill_after=2)
    assert sorted(got) == sorted(r.row_id for r in rows[:12])
    assert server.stats()["workers_died"] == 1 and server.stats()["workers_done"] == 1
    assert segment_paths(prefix) == []


@pytest.mark.timeout(180)  # without the stall watchdog this test would wait forever
def test_hung_worker_is_killed_and_its_rows_reissued_exactly_once(target, request, caplog):
    """kill -STOP one of two workers mid-run (alive, silent: a stuck GPU or engine): once the trainer has waited
    stall_timeout_s for it, it is killed and its rows go to the other worker; every row arrives exactly once."""
    rows = make_rows(16)
    prefix = _prefix(request)
    # 15 s: the healthy worker must never look hung, even starved by a vLLM engine on the other xdist worker (at 5 s
    # it once went 5 s without a row in CI and was killed too)
    server = FeatureServer(target, SPEC, rows, cfg(workers=2, capacity_mb=1e-6, stall_timeout_s=15), shm_prefix=prefix,
                           max_worker_restarts=0)
    got = []
    for sample in server:
        got.append(sample.row_id)
        if len(got) == 2:  # one that has loaded the target (a worker still loading gets load_timeout_s)
            loaded = next(w for w, s in server.stats()["per_worker"].items() if s["samples"])
            hung = server.worker_pids()[loaded]
            os.kill(hung, signal.SIGSTOP)
    stats = server.stats()
    assert sorted(got) == sorted(r.row_id for r in rows)  # nothing lost, nothing twice
    assert stats["workers_stalled"] == stats["workers_died"] == 1 and stats["rows_reissued"] >= 1
    assert re.search(rf"\(pid {hung}\) sent nothing for \d+ s while the trainer waited", caplog.text)
    assert "feature_server.stall_timeout_s=15" in caplog.text
    assert not os.path.exists(f"/proc/{hung}") and segment_paths(prefix) == []


@pytest.mark.slow  # waits out a 20 s load timeout
@pytest.mark.timeout(180)
def test_worker_hung_while_loading_is_replaced(target, request, caplog):
    rows = make_rows(4)
    prefix = _prefix(request)
    server = FeatureServer(target, SPEC, rows, cfg(load_timeout_s=20), shm_prefix=prefix, max_worker_restarts=1)
    server.start()
    hung = server.worker_pids()[0]
    os.kill(hung, signal.SIGSTOP)  # spawned a moment ago: still importing torch, long before its "ready"
    got = [sample.row_id for sample in server]
    assert sorted(got) == sorted(r.row_id for r in rows)
    assert server.stats()["workers_stalled"] == 1 and server.stats()["workers_done"] == 1
    assert "(loading the target; feature_server.load_timeout_s=20)" in caplog.text
    assert segment_paths(prefix) == []


def test_argument_errors(target):
    rows = make_rows(3)
    with pytest.raises(ValueError, match="rank"):
        FeatureServer(target, SPEC, rows, cfg(), rank=2, num_ranks=2)
    with pytest.raises(ValueError, match="valid names: \\['hf'"):
        FeatureServer(target, SPEC, rows, cfg(backend="nope"))
    with pytest.raises(ValueError, match=f"row id {rows[0].row_id} appears twice"):
        FeatureServer(target, SPEC, rows + rows[:1], cfg())
    with pytest.raises(ValueError, match="need >= 1 worker"):
        FeatureServer(target, SPEC, rows, cfg(), devices=[])
    with pytest.raises(ValueError, match="feature_server.capacity_mb"):
        FeatureServer(target, SPEC, rows, cfg(capacity_mb=0))


def _stream_ids(server, rows, **kwargs) -> list[int]:
    got = [s.row_id for s in server.stream(rows, **kwargs)]
    assert len(got) == len(set(got)), f"a row arrived twice in one stream: {got}"
    return got


@pytest.mark.slow  # two spawned workers: ~15 s on 2 cores
def test_one_server_streams_epoch_after_epoch_with_one_target_load_per_worker(target, request):
    """A run's server (rows=None): three epochs, a resumed epoch (skips) and an epoch with fewer rows than workers
    all go through the same two workers, which load the target once; nothing lost, nothing twice."""
    rows = make_rows(9)
    prefix = _prefix(request)
    with FeatureServer(target, SPEC, None, cfg(workers=2), shm_prefix=prefix) as server:
        for _ in range(3):
            assert sorted(_stream_ids(server, rows)) == sorted(r.row_id for r in rows)
        skip = frozenset(r.row_id for r in rows[:7])
        assert sorted(_stream_ids(server, rows, skip_row_ids=skip)) == sorted(r.row_id for r in rows[7:])
        assert _stream_ids(server, rows, skip_row_ids=frozenset(r.row_id for r in rows)) == []  # an epoch already done
        assert sorted(_stream_ids(server, rows[:1])) == [rows[0].row_id]  # one row, two workers
        stats = server.stats()
    assert stats["streams"] == 6 and stats["engine_loads"] == 2 and stats["engine_loads_per_slot"] == {0: 1, 1: 1}
    assert stats["samples"] == 3 * 9 + 2 + 1
    assert (stats["rows_reissued"], stats["duplicates_dropped"], stats["workers_died"]) == (0, 0, 0)
    assert server.stats()["workers_done"] == 2  # stopped politely at close, between streams
    assert segment_paths(prefix) == []


@pytest.mark.slow
def test_a_worker_that_dies_between_epochs_is_replaced_and_the_next_epoch_completes(target, request):
    rows = make_rows(6)
    prefix = _prefix(request)
    with FeatureServer(target, SPEC, None, cfg(workers=2), shm_prefix=prefix, max_worker_restarts=1) as server:
        assert len(_stream_ids(server, rows)) == 6
        os.kill(server.worker_pids()[0], signal.SIGKILL)  # idle, owing nothing
        assert sorted(_stream_ids(server, rows)) == sorted(r.row_id for r in rows)
        stats = server.stats()
    assert stats["workers_died"] == 1 and len(stats["per_worker"]) == 3  # a replacement took its slot
    # Rows handed to it before its death was noticed (its round-robin half, all within 2 * batch_tokens) are
    # reissued, never delivered twice.
    assert stats["duplicates_dropped"] == 0 and stats["rows_reissued"] <= 3
    assert segment_paths(prefix) == []


def test_stream_is_for_run_servers_and_one_at_a_time(target):
    rows = make_rows(2)
    with pytest.raises(RuntimeError, match="rows=None"):
        FeatureServer(target, SPEC, rows, cfg()).stream(rows)
    server = FeatureServer(target, SPEC, None, cfg())
    with pytest.raises(RuntimeError, match="build it with rows=None"):
        iter(server).__next__()


def test_fp8_states_cross_with_their_scales_and_come_back_within_the_e4m3_bound(target, request):
    """feature_server.hidden_dtype=float8_e4m3fn: the worker quantises each [position, layer] of what ships (here a
    windowed context and a response layer), the ring carries 1 byte a value and the scales, and multiplied back
    they are the target's fp32 states within e4m3's bound (core/contract.py quantise_fp8)."""
    spec = FeatureSpec(SPEC.layer_ids, "float8_e4m3fn", context_window=2, response_layer_ids=(LAYERS,))
    rows = make_rows(6)
    exact = {r.row_id: h for r, h in zip(rows, HFBackend(target, SPEC).extract(rows))}  # fp32, whole rows
    with FeatureServer(target, spec, rows, cfg(), shm_prefix=_prefix(request)) as server:
        got = {s.row_id: s for s in server}
        stats = server.stats()
    assert set(got) == set(exact)
    for row in rows:
        sample = got[row.row_id]
        assert sample.hidden_TLD.dtype == sample.response_RLD.dtype == torch.float8_e4m3fn
        want = FeatureSample(row.row_id, sample.input_ids_T, sample.loss_mask_T, exact[row.row_id]).shipped(spec)
        back = sample.dequantised()
        for x_NLD, back_NLD in ((want.hidden_TLD, back.hidden_TLD), (want.response_RLD, back.response_RLD)):
            assert ((back_NLD - x_NLD).abs() <= fp8_bound(x_NLD) + 1e-6).all(), row.row_id  # + the forwards' noise
        assert sample.hidden_scale_TL.shape == sample.hidden_TLD.shape[:2]  # one fp32 scale a position and layer
    assert stats["samples"] == len(rows) and segment_paths(_prefix(request)) == []
