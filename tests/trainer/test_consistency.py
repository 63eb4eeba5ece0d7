"""Every rank trains one dataset (specdistill/trainer/consistency.py): two "nodes" on this machine - two processes in
one gloo group, each with its own cache - pass with identical copies of the data and stop, both of them, naming the
node, the rank and the field when one node's copy has a changed row."""

import json
import os
import socket
import subprocess
import sys

import pytest
import torch

from specdistill.data.config import DataConfig
from specdistill.data.selection import load_selected
from specdistill.launch.tokenizer import save_tokenizer, workload_tokenizer
from specdistill.trainer.consistency import (check_same_dataset, dataset_fingerprint, first_difference,
                                             prepared_state_hashes)
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
    assert check_same_dataset(a, DistContext(0, 1, 0, torch.device("cpu"))) == [a]  # no process group: one rank
    c = fingerprint(write_jsonl(tmp_path / "c" / "train.jsonl", rows(changed=True)), tok_dir, tmp_path / "c" / "cache",
                    rank=1, drafter_state=[("d2t", "0f")])
    error = first_difference([a, c])
    assert error.startswith("dataset check before the first step: node 1 (rank 1, host ") and \
        "train_file_sha256 differs" in error and "The data file's bytes differ between nodes" in error
    assert "also different: train_store, drafter.d2t." in error
    newer = {**a, "rank": 1, "node": 1, "transformers": "0.0.1"}
    assert "transformers differs" in first_difference([a, newer]) and "Install the same" in first_difference([a, newer])


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
from specdistill.trainer.consistency import check_same_dataset, dataset_fingerprint
from specdistill.trainer.distributed import close, init_distributed

ctx = init_distributed("cpu", timeout_s=120)
tok_dir, cache = sys.argv[1], sys.argv[2]
for data in sys.argv[3:]:
    rows, _, _ = load_selected(data, tok_dir, cache, 4096, DataConfig(tokenize_workers=1), progress=False)
    vocab = hashlib.sha256(build_draft_vocab(rows, 32).numpy().tobytes()).hexdigest()[:16]
    try:
        fingerprint = dataset_fingerprint(tok_dir, {"train": (data, rows)}, [("eagle3.d2t", vocab)], ctx.rank)
        check_same_dataset(fingerprint, ctx)
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
