"""Data settings: the single place their defaults are stated (conf/data/*.yaml only overrides)."""

from dataclasses import dataclass


@dataclass
class DataConfig:
    # synthetic: workload prompts answered by the target | corpus: windows of real text (specdistill/data/corpus.py) continued
    # by the target (specdistill/data/corpus_workload.py) | jsonl: your files (.jsonl, .parquet or .arrow, despite the name)
    source: str = "synthetic"
    train_path: str | None = None
    heldout_path: str | None = None
    rows: int = 256  # synthetic and corpus
    heldout_rows: int = 32
    prompt_tokens: int = 400  # synthetic: the median prompt (~5k in production); corpus: the longest prompt
    prompt_spread: float = 0.0  # synthetic: sigma of the log prompt length (0.3: lengths spread like real prompts)
    prompt_min_tokens: int = 96  # corpus: the shortest prompt
    max_new_tokens: int = 48  # ~45-token responses in production
    generation_backend: str = "auto"  # synthetic and corpus: auto | vllm | hf (specdistill/data/generate.py resolve_backend)
    seed: int = 0
    # A row longer than a pack (trainer.token_budget): left = keep the response and the last prompt tokens that
    # fit | skip. Both are counted (metrics.json skipped_rows); specdistill/data/selection.py.
    truncate: str = "left"
    # A run whose skipped rows exceed this fraction of its file stops before training, naming the settings to change.
    max_skipped_fraction: float = 0.01
    tokenize_workers: int | None = None  # processes for the first tokenization of a file; None = the node's cores
