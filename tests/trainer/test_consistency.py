"""Every rank trains one dataset (specdistill/trainer/consistency.py): two "nodes" on this machine - two processes in
one gloo group, each with its own cache - pass with identical copies of the data and stop, both of them, naming the
node, the rank and the field when one node's copy has a changed row; through the Trainer, also when the nodes' drafters
differ or one node's start raises."""

import datetime
import json
import os
import shutil
import socket
import subprocess
import sys

import pytest
import torch

from specdistill.data.config import DataConfig
from specdistill.data.selection import load_selected
from specdistill.launch.tokenizer import save_tokenizer, workload_tokenizer
from specdistill.trainer.consistency import (check_same_start, dataset_fingerprint, first_difference,
                                             prepared_state_hashes, run_settings)
from specdistill.trainer.distributed import DistContext
from tests.cli import REPO
from tests.files import write_jsonl


def rows(changed: bool = False) -> list[dict]:
    out = [{"messages": [{"role": "user", "content": f"red shoes size {i}"},
                         {"role": "assistant", "content": json.dumps({"size": i})}]} for i in range(12)]
    if changed:
        out[5]["messages"][1]["content"] = json.dumps({"size": 50})  # one answer edited on one node
    return out


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokenizer")
    save_tokenizer(workload_tokenizer(), path)
    return path


def fingerprint(path, tok_dir, cache, **kw):
    selected, _, _ = load_selected(path, tok_dir, cache, 4096, DataConfig(tokenize_workers=1), progress=False)
    return dataset_fingerprint(tok_dir, {"train": (path, selected), "heldout": (None, None)}, **kw)


def test_fingerprints_agree_on_copies_and_name_the_first_field_that_differs(tmp_path, tok_dir):
    a = fingerprint(write_jsonl(tmp_path / "a" / "train.jsonl", rows()), tok_dir, tmp_path / "a" / "cache")
    b = fingerprint(write_jsonl(tmp_path / "b" / "train.jsonl", rows()), tok_dir, tmp_path / "b" / "cache", rank=1)
    assert first_difference([a, b]) is None  # other paths, other caches, same bytes: the same dataset
    assert check_same_start(DistContext(0, 1, 0, torch.device("cpu")), lambda: a) == [a]  # no process group: one rank
    c = fingerprint(write_jsonl(tmp_path / "c" / "train.jsonl", rows(changed=True)), tok_dir, tmp_path / "c" / "cache",
                    rank=1, drafter_state=[("d2t", "0f")])
    error = first_difference([a, c])
    assert error.startswith("dataset check before the first step: node 1 (rank 1, host ") and \
        "train_file_sha256 differs" in error and "The data file's bytes differ between nodes" in error
    assert "also different: train_store, train_store_content, drafter.d2t." in error
    newer = {**a, "rank": 1, "node": 1, "transformers": "0.0.1"}
    assert "transformers differs" in first_difference([a, newer]) and "Install the same" in first_difference([a, newer])


def test_settings_versions_and_the_target_are_compared_and_where_a_node_keeps_its_files_is_not(tmp_path, tok_dir):
    resolved = {"cache_dir": "/a/cache", "target": {"name": None, "path": "/a/model"},
                "data": {"train_path": "/a/train.jsonl", "loss_on": "all", "tokenize_workers": None},
                "trainer": {"lr": 0.003, "threads": None}, "drafters": ["dflash"]}
    elsewhere = {"cache_dir": "/b/cache", "target": {"name": None, "path": "/b/model"},
                 "data": {"train_path": "/b/train.jsonl", "loss_on": "all", "tokenize_workers": 64},
                 "trainer": {"lr": 0.003, "threads": 8}, "drafters": ["dflash"]}
    assert run_settings("hf", "bfloat16", resolved) == run_settings("hf", "bfloat16", elsewhere)
    ref = dataset_fingerprint(tok_dir, {}, settings=run_settings("hf", "bfloat16", resolved))

    def on_rank_1(**changes) -> str:
        return first_difference([ref, {**ref, "rank": 1, "node": 1, **changes}])

    lr = on_rank_1(**run_settings("hf", "bfloat16", {**resolved, "trainer": {"lr": 0.001, "threads": None}}))
    assert "config.trainer.lr differs: 0.003 on rank 0, 0.001 on rank 1" in lr and "only cache_dir, target.path" in lr
    assert "hidden_dtype differs" in on_rank_1(hidden_dtype="float16")
    assert "vllm differs" in on_rank_1(vllm="0.0.1") and "torch and vllm on every node" in on_rank_1(vllm="0.0.1")
    model = tmp_path / "model"  # the same tokenizer, another config.json
    shutil.copytree(tok_dir, model)
    (model / "config.json").write_text('{"num_hidden_layers": 3}')
    other = dataset_fingerprint(model, {}, rank=1, settings=run_settings("hf", "bfloat16", resolved))
    assert "target_sha256 differs" in first_difference([ref, other]) and "config.json or weight files" in \
        first_difference([ref, other])


def test_one_store_key_built_on_another_day_holds_other_tokens_and_is_told_apart(tmp_path, tok_dir, monkeypatch):
    """A template that renders today's date (as Llama 3's does) tokenizes one file to other tokens on another day,
    under the same store key: the store's content hash, taken when it was built, tells them apart."""
    dated = tmp_path / "dated"
    shutil.copytree(tok_dir, dated)
    config = json.loads((dated / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{- 'Today is ' + strftime_now('%d %B %Y') + '\\n' }}" + config["chat_template"]
    (dated / "tokenizer_config.json").write_text(json.dumps(config))
    path = write_jsonl(tmp_path / "train.jsonl", rows())
    today = fingerprint(path, dated, tmp_path / "node0")

    class AnotherDay(datetime.datetime):
        @classmethod
        def now(cls, tz=None):
            return datetime.datetime(2031, 7, 14)

    import transformers.utils.chat_template_utils as templates

    monkeypatch.setattr(templates, "datetime", AnotherDay)
    later = fingerprint(path, dated, tmp_path / "node1", rank=1)
    assert later["train_store"] == today["train_store"]  # one key
    error = first_difference([today, later])
    assert "train_store_content differs" in error and "today's date" in error


def test_prepared_state_hashes_cover_integer_buffers_only():
    m = torch.nn.Module()
    m.register_buffer("d2t", torch.arange(4))
    m.register_buffer("t2d", torch.ones(8, dtype=torch.bool))
    m.register_buffer("inv_freq", torch.rand(4))
    names = [n for n, _ in prepared_state_hashes(m)]
    assert names == ["d2t", "t2d"]
    before = dict(prepared_state_hashes(m))
    m.d2t[0] = 3
    assert dict(prepared_state_hashes(m))["d2t"] != before["d2t"]


NODE = """
import hashlib, sys
from specdistill.data.config import DataConfig
from specdistill.data.selection import load_selected
from specdistill.drafters.eagle3 import build_draft_vocab
from specdistill.trainer.consistency import check_same_start, dataset_fingerprint
from specdistill.trainer.distributed import close, init_distributed

ctx = init_distributed("cpu", timeout_s=120)
tok_dir, cache = sys.argv[1], sys.argv[2]
for data in sys.argv[3:]:
    rows, _, _ = load_selected(data, tok_dir, cache, 4096, DataConfig(tokenize_workers=1), progress=False)
    vocab = hashlib.sha256(build_draft_vocab(rows, 32).numpy().tobytes()).hexdigest()[:16]
    try:
        check_same_start(ctx, lambda: dataset_fingerprint(tok_dir, {"train": (data, rows)}, [("eagle3.d2t", vocab)],
                                                          ctx.rank))
        print("SAME", data, flush=True)
    except ValueError as e:
        print("REFUSED", e, flush=True)
close(ctx)
"""


def test_two_nodes_with_a_changed_file_stop_naming_the_node_and_the_field(tmp_path, tok_dir):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for node in (0, 1):
        root = tmp_path / f"node{node}"  # its own data copy and cache, as on a node without a shared cache
        same = write_jsonl(root / "same.jsonl", rows())
        changed = write_jsonl(root / "train.jsonl", rows(changed=node == 1))
        env = {**os.environ, "RANK": str(node), "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
               "GROUP_RANK": str(node), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, "-c", NODE, str(tok_dir), str(root / "cache"), str(same),
                                       str(changed)], cwd=REPO, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=240) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
        lines = out.splitlines()
        assert lines[0].startswith("SAME") and lines[1].startswith("REFUSED"), out + err[-2000:]
        refusal = lines[1][len("REFUSED "):]
        assert refusal.startswith("dataset check before the first step: node 1 (rank 1, host ")
        assert "train_file_sha256 differs" in refusal and str(tmp_path / "node1" / "train.jsonl") in refusal
        assert str(tmp_path / "node0" / "train.jsonl") in refusal
        assert "eagle3.d2t" in refusal
    print(refusal)  # the message a run stops with (-s shows it)


# Two "nodes" (one rank each, their own copies of the data and caches) build the Trainer through cases, each in a
# fresh process group on its own port. The Trainer's collective timeout is short: a rank left waiting for one that
# stopped would fail with a timeout, not the dataset message.
TRAINER_NODE = """
import json, os, sys, time
from pathlib import Path
from specdistill.data.config import DataConfig
from specdistill.drafters import drafter_config
from specdistill.feature_server.config import FeatureServerConfig
from specdistill.trainer import distributed
from specdistill.trainer.config import TrainerConfig
from specdistill.trainer.trainer import Trainer

target, cache, run_dir, cases = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), json.loads(sys.argv[4])
for case in cases:
    os.environ["MASTER_PORT"] = str(case["port"])
    cfg = TrainerConfig(max_steps=2, ranks=1, device="cpu", threads=1, token_budget=256, progress=False,
                        eval_every=0, collective_timeout_s=60)
    resolved = {"cache_dir": str(cache), "data": {"train_path": case["train"], "rows": 16},
                "drafters": case["drafters"], "trainer": {"lr": cfg.lr, "token_budget": cfg.token_budget}}
    started = time.perf_counter()
    try:
        trainer = Trainer(drafter_config("dflash"), cfg, FeatureServerConfig(workers=1), run_dir, target,
                          Path(case["train"]), None, resolved_config=resolved,
                          data_cfg=DataConfig(tokenize_workers=1), cache_dir=cache, entries=case["drafters"])
        distributed.close(trainer.dist)
        del trainer
        print(json.dumps({"case": case["name"], "started": True}), flush=True)
    except Exception as e:
        print(json.dumps({"case": case["name"], "error": f"{type(e).__name__}: {e}",
                          "seconds": round(time.perf_counter() - started, 1)}), flush=True)
"""
EAGLE3 = {"drafter": "eagle3", "draft_vocab_size": 64}
DFLASH = {"drafter": "dflash", "num_layers": 1, "max_anchors": 16, "block_size": 4}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _node_files(root, train, heldout, node: int) -> dict:
    """This node's copies: the same rows; other rows (the held-out file's) on node 1; torn on node 1 (cut in the
    middle of a row, as a copy interrupted part way leaves it)."""
    text = train.read_text()
    files = {"same": text, "other": heldout.read_text() if node else text,
             "torn": text[: len(text) * 2 // 3] if node else text}
    for name, content in files.items():
        (root / f"{name}.jsonl").parent.mkdir(parents=True, exist_ok=True)
        (root / f"{name}.jsonl").write_text(content)
    return {name: str(root / f"{name}.jsonl") for name in files}


@pytest.mark.slow
def test_trainer_ranks_stop_together_at_the_dataset_check_before_any_other_collective(tmp_path,
                                                                                     tiny_llama_workload):
    """Through the Trainer on 2 gloo ranks: copies of one file start (only paths and caches differ); other
    drafters=[...] lists, other rows (EAGLE-3's draft vocabulary hashed before DDP broadcasts rank 0's) and a torn
    file on one rank (its load raises) stop both ranks with the dataset message, none waiting in DDP's setup."""
    target, train, heldout = tiny_llama_workload
    names = ("same", "drafters", "other", "torn")
    ports = [_free_port() for _ in names]
    procs = []
    for node in (0, 1):
        root = tmp_path / f"node{node}"
        files = _node_files(root, train, heldout, node)
        cases = [{"name": "same", "train": files["same"], "drafters": [EAGLE3]},
                 {"name": "drafters", "train": files["same"], "drafters": [EAGLE3, DFLASH] if node else [EAGLE3]},
                 {"name": "other", "train": files["other"], "drafters": [EAGLE3]},
                 {"name": "torn", "train": files["torn"], "drafters": [EAGLE3]}]
        for case, port in zip(cases, ports):
            case["port"] = port
        env = {**os.environ, "RANK": str(node), "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
               "GROUP_RANK": str(node), "MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, "-c", TRAINER_NODE, str(target), str(root / "cache"),
                                       str(tmp_path / "run"), json.dumps(cases)], cwd=REPO, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=900) for p in procs]
    results = []
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
        results.append({r["case"]: r for r in map(json.loads, out.splitlines())})
    for rank, got in enumerate(results):
        context = json.dumps(got, indent=1)[-4000:]
        assert got["same"] == {"case": "same", "started": True}, context
        node1 = "dataset check before the first step: node 1 (rank 1, host "
        drafters, other, torn = (got[name].get("error", "") for name in ("drafters", "other", "torn"))
        assert drafters.startswith(f"ValueError: {node1}") and "config.drafters differs" in drafters, context
        assert other.startswith(f"ValueError: {node1}") and "train_file_sha256 differs" in other, context
        assert "drafter.eagle3.d2t" in other, context  # hashed on each rank before DDP broadcast rank 0's
        assert torn.startswith(f"ValueError: {node1}") and "DatasetError" in torn, context
        assert str(tmp_path / "node1" / "torn.jsonl") in torn, context  # the failing rank's own error, on both
        print(f"rank {rank}: stopped {got['torn']['seconds']} s after starting the Trainer: {torn}")
