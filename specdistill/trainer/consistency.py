"""Every rank trains one dataset: checked before the first step.

Rows are dealt by position (row i to rank i % R: specdistill/feature_server/ledger.py shard_rows) and each node
builds or maps its own token store, so nodes that loaded different rows - another copy of the data file, another
tokenizer or library version, another setting - would each train their shard of a different dataset, and nothing
would say so. Before the first step every rank all-gathers a fingerprint of what it loaded (`dataset_fingerprint`)
and any difference from rank 0's stops every rank (`check_same_dataset`), naming the node, the rank, the field and
both values. Metadata only: a few hundred bytes a rank, one all-gather.

Fields, compared in this order (the first that differs explains the ones after it; all are listed):
  transformers, tokenizers, jinja2   the library versions that render and tokenize (the store key holds them too)
  tokenizer_sha256                   the target's tokenizer files, chat template and generation_config.json
  train_file_sha256                  the training file's bytes (memoised beside the token store: no re-read)
  train_store                        the token store's key (file, tokenizer, settings, versions)
  train_rows, train_tokens           rows kept by the selection, and their tokens
  train_response_tokens              response tokens of the store (its meta.json)
  train_selection                    which rows, cut where (a hash of the selection)
  heldout_* (the same, when the run has held-out rows)
  drafter.<name>                     the drafter's data-dependent state, e.g. EAGLE-3's draft vocabulary (d2t, t2d)
Recorded, not compared (paths and hosts may differ between nodes): node, rank, host, train_path, heldout_path.
"""

import hashlib
import os
import socket
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch

from specdistill.core.rows import Rows
from specdistill.data.token_store import StoreRows, content_digest, library_versions, tokenizer_digest
from specdistill.trainer.distributed import DistContext, gather_objects

INFO = ("node", "rank", "host", "train_path", "heldout_path")
_HINTS = {  # what to do when a field is the first that differs
    "library": "Install the same transformers, tokenizers and jinja2 on every node (pip show transformers "
               "tokenizers jinja2)",
    "tokenizer_sha256": "Every node must read the same target directory (target.path): its tokenizer files, chat "
                        "template or generation_config.json differ",
    "file_sha256": "The data file's bytes differ between nodes: give every node the same file (on shared storage, "
                   "or identical copies: compare sha256sum FILE on each node)",
    "store": "The same file and tokenizer gave another token store: a tokenization setting (data.chat_template_kwargs, "
             "data.loss_on, data.bad_rows) differs between nodes",
    "selection": "The same store gave another selection: data.truncate, trainer.token_budget or the target's "
                 "context (max_position_embeddings) differs between nodes",
    "drafter": "The data matches but the drafter's data-dependent state does not: a drafter setting or its "
               "drafter.init_from export differs between nodes",
}


def node_rank(rank: int) -> int:
    """The node of this process: torchrun's (and specdistill.launch.ray_job's) GROUP_RANK, else rank // ranks per
    node."""
    if "GROUP_RANK" in os.environ:
        return int(os.environ["GROUP_RANK"])
    return rank // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def prepared_state_hashes(module: torch.nn.Module) -> list[tuple[str, str]]:
    """(buffer name, sha256) of a module's integer and boolean buffers: the state a drafter's prepare() derives from
    the data (EAGLE-3's d2t and t2d). Float buffers (rotary caches) are left out: computed, not derived from data."""
    out = []
    for name, buf in module.named_buffers():
        if buf.dtype.is_floating_point or buf.dtype.is_complex:
            continue
        if hasattr(buf, "full_tensor"):  # a DTensor (a wrapped module): every rank calls this, in the same order
            buf = buf.full_tensor()
        out.append((name, hashlib.sha256(buf.detach().cpu().contiguous().numpy().tobytes()).hexdigest()[:16]))
    return out


def dataset_fingerprint(target_dir: str | Path, row_sets: dict[str, tuple[str | Path | None, Rows]],
                        drafter_state: Iterable[tuple[str, str]] = (), rank: int = 0) -> dict:
    """What this rank loaded (see the module docstring): versions, tokenizer, and per row set ("train", "heldout":
    (the data file this rank read, its selected rows); a set without a file or rows is left out) its file, store,
    selection and counts; `drafter_state` = (name, hash) pairs, e.g. prepared_state_hashes(drafter)."""
    fp = {"node": node_rank(rank), "rank": rank, "host": socket.gethostname(), **library_versions(),
          "tokenizer_sha256": tokenizer_digest(Path(target_dir))[:16]}
    for name, (path, rows) in row_sets.items():
        if path is not None and rows is not None and len(rows):
            fp.update(_rows_fingerprint(name, Path(path), rows))
    fp.update({f"drafter.{name}": value for name, value in drafter_state})
    return fp


def _rows_fingerprint(prefix: str, path: Path, rows: Rows) -> dict:
    out = {f"{prefix}_path": str(path)}
    if isinstance(rows, StoreRows):
        # memoised beside the store when its key was computed (specdistill/data/token_store.py): a stat, not a read
        out[f"{prefix}_file_sha256"] = content_digest(path, rows.store.dir.parent / "digests")[:16]
        out[f"{prefix}_store"] = rows.store.dir.name
    out[f"{prefix}_rows"] = len(rows)
    out[f"{prefix}_tokens"] = int(np.asarray(rows.num_tokens).sum())
    if isinstance(rows, StoreRows):
        out[f"{prefix}_response_tokens"] = int(rows.store.meta["response_tokens"])
        out[f"{prefix}_selection"] = rows.selection_key(0)[:16]
    else:  # rows held in memory (tests, small sets): their contents
        h = hashlib.sha256()
        for r in rows:
            h.update(np.asarray(r.input_ids, np.int64).tobytes() + np.asarray(r.loss_mask, np.int8).tobytes())
        out[f"{prefix}_selection"] = h.hexdigest()[:16]
    return out


def first_difference(fingerprints: list[dict]) -> str | None:
    """The error for the first rank whose fingerprint differs from rank 0's (None when all agree)."""
    ref = fingerprints[0]
    for other in fingerprints[1:]:
        fields = [k for k in (*ref, *(k for k in other if k not in ref)) if k not in INFO]
        differ = [k for k in fields if ref.get(k) != other.get(k)]
        if differ:
            return _message(ref, other, differ)
    return None


def _message(ref: dict, other: dict, differ: list[str]) -> str:
    field = differ[0]

    def who(fp: dict) -> str:
        return f"node {fp['node']} (rank {fp['rank']}, host {fp['host']})"

    def value(fp: dict) -> str:
        prefix = field.split("_", 1)[0]
        path = fp.get(f"{prefix}_path") if prefix in ("train", "heldout") else None
        return f"{fp.get(field, '<absent>')!r} on rank {fp['rank']}" + (f" ({path})" if path else "")

    also = f"; also different: {', '.join(differ[1:])}" if len(differ) > 1 else ""
    return (f"dataset check before the first step: {who(other)} did not load what {who(ref)} loaded: {field} "
            f"differs: {value(ref)}, {value(other)}{also}. {_hint(field)}.")


def _hint(field: str) -> str:
    if field in ("transformers", "tokenizers", "jinja2"):
        return _HINTS["library"]
    if field.startswith("drafter."):
        return _HINTS["drafter"]
    for suffix in ("tokenizer_sha256", "file_sha256", "store"):
        if field.endswith(suffix):
            return _HINTS[suffix]
    return _HINTS["selection"]


def check_same_dataset(fingerprint: dict, ctx: DistContext) -> list[dict]:
    """All-gather every rank's fingerprint; raise the same ValueError on every rank (so all of them stop, none waits
    in a later collective) when one differs from rank 0's. Returns the gathered fingerprints (one, without a
    process group)."""
    everyone = gather_objects(fingerprint, ctx)
    problem = first_difference(everyone)
    if problem:
        raise ValueError(problem)
    return everyone
