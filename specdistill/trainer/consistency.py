"""Every rank trains one dataset: checked right after the process group is up, before any other collective.

Rows are dealt by position (row i to rank i % R: specdistill/feature_server/ledger.py shard_rows) and each node
builds or maps its own token store, so nodes that loaded different rows - another copy of the data file, another
tokenizer or library version, another setting - would each train their shard of a different dataset, and nothing
would say so. Right after the process group is up each rank runs its start (settings checked, target and data
loaded, drafters built and prepared, not yet wrapped for DDP/FSDP, whose setup runs collectives) and all-gathers
either a fingerprint of what it loaded (`dataset_fingerprint`) or the text of the error its start raised
(`check_same_start`). A rank that failed, or a fingerprint that differs from rank 0's, stops every rank with the same
message, naming the node, the rank, the field and both values (or the failing rank's error). Metadata only: a few
KB a rank, one all-gather.

Fields, compared in this order (the first that differs explains the ones after it; all are listed):
  transformers, tokenizers, jinja2,  the library versions that render, tokenize and train (the store key holds the
  torch, vllm                        first three too)
  tokenizer_sha256                   the target's tokenizer files, chat template and generation_config.json
  target_sha256                      the target's config.json and weight index (*.index.json, and each weight
                                     file's name, size and safetensors header: a few KB read, not the weights)
  feature_backend, hidden_dtype      how the target's states are made and what crosses to the trainer
  config.<field>                     the resolved run config, less NODE_FIELDS
  train_file_sha256                  the training file's bytes (memoised beside the token store: no re-read)
  train_store                        the token store's key (file, tokenizer, settings, versions)
  train_store_content                the store's tokens, loss mask and row bounds (hashed once when it was built:
                                     one key can build other tokens, e.g. a template that renders today's date)
  train_rows, train_tokens           rows kept by the selection, and their tokens
  train_response_tokens              response tokens of the store (its meta.json)
  train_selection                    which rows, cut where (a hash of the selection)
  heldout_* (the same, when the run has held-out rows)
  drafter.<name>                     the drafter's data-dependent state, e.g. EAGLE-3's draft vocabulary (d2t, t2d),
                                     hashed before DDP broadcasts rank 0's
Recorded, not compared: node, rank, host, train_path, heldout_path.
"""

import hashlib
import os
import socket
import struct
from collections.abc import Callable, Iterable
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import numpy as np
import torch

from specdistill.core.rows import Rows
from specdistill.data.token_store import StoreRows, content_digest, library_versions, tokenizer_digest
from specdistill.trainer.distributed import DistContext, gather_objects

INFO = ("node", "rank", "host", "train_path", "heldout_path")
# Resolved config fields that may differ between nodes: where each node finds its files (the files themselves are
# compared by content above) and how it uses its own cores. Nothing else may: a node given another setting trains
# another run.
NODE_FIELDS = ("cache_dir", "target.path", "data.train_path", "data.heldout_path", "data.tokenize_workers",
               "trainer.threads", "trainer.progress")
_SAME_SETTINGS = ("Start every node with the same settings (the same command line); only "
                  f"{', '.join(NODE_FIELDS)} may differ between nodes")
_HINTS = {  # what to do when a field is the first that differs
    "library": "Install the same transformers, tokenizers, jinja2, torch and vllm on every node (pip show "
               "transformers tokenizers jinja2 torch vllm)",
    "tokenizer_sha256": "Every node must read the same target directory (target.path): its tokenizer files, chat "
                        "template or generation_config.json differ",
    "target_sha256": "Every node must read the same target checkpoint (target.path): its config.json or weight "
                     "files differ",
    "settings": _SAME_SETTINGS,
    "file_sha256": "The data file's bytes differ between nodes: give every node the same file (on shared storage, "
                   "or identical copies: compare sha256sum FILE on each node)",
    "store": "The same file and tokenizer gave another token store: a tokenization setting (data.chat_template_kwargs, "
             "data.loss_on, data.bad_rows) differs between nodes",
    "store_content": "The same file, tokenizer and settings tokenized to other tokens on another node: the chat "
                     "template renders something that changes between builds (today's date, a random id). Build "
                     "the token store once for every node: cache_dir on storage every node mounts",
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


def _who(rank: int) -> dict:
    return {"node": node_rank(rank), "rank": rank, "host": socket.gethostname()}


def versions() -> dict:
    """The libraries whose version changes what a rank loads or trains: those that tokenize (library_versions),
    torch and vLLM (None where not installed)."""
    out = dict(library_versions())
    for name in ("torch", "vllm"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def target_digest(target_dir: Path) -> str:
    """sha256 of the target's config.json, its weight index files (*.index.json) and, per weight file, its name,
    size and safetensors header (every tensor's name, dtype, shape and offsets): a few KB read, not the weights."""
    h = hashlib.sha256()
    for path in sorted(Path(target_dir).iterdir()):
        if path.name == "config.json" or path.name.endswith(".index.json"):
            h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
        elif path.name.endswith((".safetensors", ".bin")) and path.is_file():
            h.update(f"{path.name}\0{path.stat().st_size}\0".encode() + _safetensors_header(path) + b"\0")
    return h.hexdigest()


_MAX_HEADER = 100 << 20  # the safetensors format's own bound on a header


def _safetensors_header(path: Path) -> bytes:
    if path.suffix != ".safetensors":
        return b""
    with path.open("rb") as f:
        (size,) = struct.unpack("<Q", f.read(8).ljust(8, b"\0"))
        return f.read(min(size, _MAX_HEADER))


def run_settings(feature_backend: str, hidden_dtype: str, resolved_config: dict | None) -> dict:
    """The settings compared between ranks: how the target's states are made and carried, and the resolved run
    config as {"config.<dotted key>": value} less NODE_FIELDS (a list is one value: drafters=[...] compares whole)."""
    out = {"feature_backend": feature_backend, "hidden_dtype": hidden_dtype}

    def walk(node: dict, prefix: str) -> None:
        for key, value in node.items():
            dotted = f"{prefix}{key}"
            if isinstance(value, dict):
                walk(value, f"{dotted}.")
            elif dotted not in NODE_FIELDS:
                out[f"config.{dotted}"] = value

    walk(resolved_config or {}, "")
    return out


def prepared_state_hashes(module: torch.nn.Module) -> list[tuple[str, str]]:
    """(buffer name, sha256) of a module's integer and boolean buffers: the state a drafter's prepare() derives from
    the data (EAGLE-3's d2t and t2d). Float buffers (rotary caches) are left out: computed, not derived from data.
    Called before the module is wrapped: DDP's setup broadcasts rank 0's buffers, after which they cannot differ."""
    out = []
    for name, buf in module.named_buffers():
        if buf.dtype.is_floating_point or buf.dtype.is_complex:
            continue
        out.append((name, hashlib.sha256(buf.detach().cpu().contiguous().numpy().tobytes()).hexdigest()[:16]))
    return out


def dataset_fingerprint(target_dir: str | Path, row_sets: dict[str, tuple[str | Path | None, Rows]],
                        drafter_state: Iterable[tuple[str, str]] = (), rank: int = 0,
                        settings: dict | None = None) -> dict:
    """What this rank loaded (see the module docstring): versions, tokenizer, target, `settings` (run_settings),
    and per row set ("train", "heldout": (the data file this rank read, its selected rows); a set without a file
    or rows is left out) its file, store, selection and counts; `drafter_state` = (name, hash) pairs, e.g.
    prepared_state_hashes(drafter)."""
    fp = {**_who(rank), **versions(), "tokenizer_sha256": tokenizer_digest(Path(target_dir))[:16],
          "target_sha256": target_digest(Path(target_dir))[:16], **(settings or {})}
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
        out[f"{prefix}_store_content"] = rows.store.content_sha256[:16]  # hashed once, when the store was built
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


_PREFIX = "dataset check before the first step"
_MAX_ERROR = 2000  # characters of a rank's error carried to the others


def failed_starts(everyone: list[dict]) -> str | None:
    """The error for the ranks whose start raised (None when none did): each one's own error, on every rank."""
    failed = [fp for fp in everyone if "error" in fp]
    if not failed:
        return None
    shown = "; ".join(f"{_who_text(fp)} could not start: {fp['error']}" for fp in failed[:3])
    more = f"; {len(failed) - 3} more ranks could not start" if len(failed) > 3 else ""
    return f"{_PREFIX}: {shown}{more}. Every rank stops here."


def first_difference(fingerprints: list[dict]) -> str | None:
    """The error for the first rank whose fingerprint differs from rank 0's (None when all agree)."""
    ref = fingerprints[0]
    for other in fingerprints[1:]:
        fields = [k for k in (*ref, *(k for k in other if k not in ref)) if k not in INFO]
        differ = [k for k in fields if ref.get(k) != other.get(k)]
        if differ:
            return _message(ref, other, differ)
    return None


def _who_text(fp: dict) -> str:
    return f"node {fp['node']} (rank {fp['rank']}, host {fp['host']})"


def _message(ref: dict, other: dict, differ: list[str]) -> str:
    field = differ[0]

    def value(fp: dict) -> str:
        prefix = field.split("_", 1)[0]
        path = fp.get(f"{prefix}_path") if prefix in ("train", "heldout") else None
        return f"{fp.get(field, '<absent>')!r} on rank {fp['rank']}" + (f" ({path})" if path else "")

    also = f"; also different: {', '.join(differ[1:])}" if len(differ) > 1 else ""
    return (f"{_PREFIX}: {_who_text(other)} did not load what {_who_text(ref)} loaded: {field} "
            f"differs: {value(ref)}, {value(other)}{also}. {_hint(field)}.")


def _hint(field: str) -> str:
    if field in ("transformers", "tokenizers", "jinja2", "torch", "vllm"):
        return _HINTS["library"]
    if field.startswith("drafter."):
        return _HINTS["drafter"]
    if field in ("feature_backend", "hidden_dtype") or field.startswith("config."):
        return _HINTS["settings"]
    for suffix in ("tokenizer_sha256", "target_sha256", "file_sha256", "store_content", "store"):
        if field.endswith(suffix):
            return _HINTS[suffix]
    return _HINTS["selection"]


def check_same_start(ctx: DistContext, start: Callable[[], dict]) -> list[dict]:
    """Run this rank's `start` (it returns the rank's fingerprint), then all-gather every rank's fingerprint, or
    the error its start raised; when a rank failed or loaded something other than rank 0, raise the same
    ValueError on every rank (the failing rank's from its own error), so all of them stop and none waits in a later
    collective. Returns the gathered fingerprints. Without a process group there is no one to tell: `start`'s own
    error stands."""
    if not ctx.enabled:
        return [start()]
    try:
        mine, error = start(), None
    except Exception as e:  # every rank learns of it below; this rank raises from it
        mine, error = {**_who(ctx.rank), "error": f"{type(e).__name__}: {e}"[:_MAX_ERROR]}, e
    everyone = gather_objects(mine, ctx)
    problem = failed_starts(everyone) or first_difference(everyone)
    if problem:
        raise ValueError(problem) from error
    return everyone
