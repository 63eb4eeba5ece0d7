"""Data settings: the single place their defaults are stated (specdistill/conf/data/*.yaml only overrides)."""

from dataclasses import dataclass
from typing import Any


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
    # Variables of the target's chat template (a mapping; None = none), for every rendering of a chat row: training,
    # the synthetic workload's prompts, specdistill-regenerate (its own chat_template_kwargs=) and the serving benches
    # must pass the same ones, e.g. data.chat_template_kwargs={enable_thinking:false} for Qwen3 served without
    # thinking. Typed Any so that a whole mapping can be given on the command line (a typed dict would take only
    # +data.chat_template_kwargs.KEY=VALUE); specdistill/data/chat.py checks it.
    chat_template_kwargs: Any = None
    # Which assistant turns of a chat row are trained (one token-store row each): all | last.
    loss_on: str = "all"
    # A malformed row (bad JSON, field or chat template error): stop = the build stops naming file, line, field and
    # message | skip = skip it, counted and named in metrics.json skipped_rows (max_skipped_fraction still applies).
    bad_rows: str = "stop"
    # A row longer than a pack (trainer.token_budget): left = keep the response and the last prompt tokens that
    # fit | skip. Both are counted (metrics.json skipped_rows); specdistill/data/selection.py.
    truncate: str = "left"
    # A run whose skipped rows exceed this fraction of its file stops before training, naming the settings to change.
    max_skipped_fraction: float = 0.01
    tokenize_workers: int | None = None  # processes for the first tokenization of a file; None = the node's cores
