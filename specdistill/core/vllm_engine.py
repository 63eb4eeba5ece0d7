"""Small helpers every vLLM engine of the project uses (feature extraction, generation, serving checks): the
engine dtype from a checkpoint, the longest row an engine prefills (`max_row_tokens`), and a shutdown that waits until
the engine's processes are gone, and the switch that keeps an engine inside its process. vLLM is imported inside the
functions, so this module loads without it."""

import gc
import os

import torch


def engine_in_this_process() -> None:
    """vLLM's own switch, read when an engine is built: its engine core runs in this process instead of an
    engine-core process and an executor process (each importing vLLM anew). For a process that is the engine's alone:
    vLLM then changes its host (docs/vllm.md "Where the engine runs")."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def max_row_tokens(context: int, token_budget: int | None = None) -> int:
    """The longest row a run trains: what the target can prefill through vLLM, at most `token_budget` (a pack).

    The one rule for the rows the data selection keeps (specdistill/data/selection.py) and the max_model_len the
    vLLM feature backend asks for (specdistill/feature_server/vllm_backend.py): a prefill-only request still
    generates one token, which vLLM counts against max_model_len, and max_model_len cannot pass the target's
    context (max_position_embeddings); so a row has at most context - 1 tokens."""
    limit = context - 1
    return limit if token_budget is None else min(token_budget, limit)


def target_text_config(target_dir: str):
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
    config = target_text_config(target_dir)
    saved = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "float32"
    return str(saved).removeprefix("torch.")


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
