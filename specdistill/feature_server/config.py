"""Feature-server settings (specdistill/conf/feature_server/*.yaml override these defaults)."""

from dataclasses import dataclass

from specdistill.core.contract import DEFAULT_HIDDEN_DTYPE


@dataclass
class FeatureServerConfig:
    backend: str = "hf"  # hf | vllm | synthetic (no model: random states, for timing the pipeline)
    workers: int = 6  # feature workers per node, split evenly over its trainer ranks (specdistill/trainer/layout.py)
    threads_per_worker: int = 1
    capacity_mb: int = 256  # shared-memory bytes in flight before workers block
    # Tokens a worker hands the target per prefill call (as many whole rows as fit; a longer row goes alone): six
    # of the mission's ~5k-token rows per vLLM generate call, so prefill runs batched (docs/scaling.md).
    batch_tokens: int = 32768
    # what crosses to the trainer (specdistill/core/contract.py): bfloat16, float32, float16, or float8_e4m3fn (a
    # scale per position and layer beside the values)
    hidden_dtype: str = DEFAULT_HIDDEN_DTYPE
    # read: each layer ships only the positions the run's drafters, the held-out walk and the baselines read (a
    # windowed drafter's context from its window before the first response token; the last layer from the first
    # response token - 1) | all: every position of every layer (the comparison). core/contract.py, docs/scaling.md
    positions: str = "read"
    device: str = "cpu"  # auto | cpu | cuda: where the target runs (specdistill/trainer/layout.py assigns GPU indices)
    # true: each trainer rank's workers run on the rank's own device, not on GPUs of their own, so one GPU holds the
    # whole loop (specdistill/conf/layout/gpu1.yaml); false: a layout needing more GPUs than the node has is refused.
    share_trainer_device: bool = False
    # vLLM backend only. true: vLLM's engine runs inside the feature worker (vLLM's VLLM_ENABLE_V1_MULTIPROCESSING=0)
    # instead of in an engine-core process and an executor process of its own, each importing vLLM anew: on 2 CPU
    # cores a tiny target's engine starts in ~3 s instead of ~25 s and stops in ~2 s instead of ~5 s. false: vLLM's
    # own layout, as production runs it (the in-worker engine is unmeasured on GPUs). conf/feature_server/vllm.yaml
    # reads the default from SPECDISTILL_VLLM_ENGINE_IN_WORKER, which the test suite sets (docs/vllm.md).
    engine_in_worker: bool = False
    dtype: str | None = None  # target compute dtype; None = the checkpoint's
    # A worker that owes rows and sends nothing this long while the trainer waits is hung (a stuck GPU, a
    # deadlocked engine), not slow: it is killed and its rows reissued. Loading the target gets the longer bound.
    stall_timeout_s: float = 600.0
    load_timeout_s: float = 1800.0
