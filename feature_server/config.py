"""Feature-server settings (conf/feature_server/*.yaml override these defaults)."""

from dataclasses import dataclass


@dataclass
class FeatureServerConfig:
    backend: str = "hf"  # hf | vllm
    workers: int = 1  # target workers per trainer rank (6 per node in production)
    threads_per_worker: int = 1
    capacity_mb: int = 256  # shared-memory bytes in flight before workers block
    hidden_dtype: str = "bfloat16"
    device: str = "cpu"  # where the target runs
    dtype: str | None = None  # target compute dtype; None = the checkpoint's
