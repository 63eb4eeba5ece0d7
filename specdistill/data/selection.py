"""Which rows of a token store a run trains on, given its pack size: the settings applied when the store is read.

A row longer than a pack (`trainer.token_budget` tokens), or than the target can prefill (its context - 1:
`specdistill.core.vllm_engine.max_row_tokens`, the rule the vLLM feature backend's max_model_len follows too), cannot
be trained whole. `data.truncate` says what happens:
  left  keep the response and as many of the last prompt tokens as fit (the prompt is cut on the left; the target
        prefills the cut row, so its states and the drafter's context agree); counted. A row whose response alone
        is longer than the limit is skipped (counted as response_longer_than_pack).
  skip  skip the row (counted as too_long).
A run whose skipped rows exceed `data.max_skipped_fraction` of the file stops before training (`check_skipped`):
a silently biased sample (only the short prompts trained) is worse than an error.
"""

import json
from pathlib import Path

import numpy as np

from specdistill.core.vllm_engine import max_row_tokens
from specdistill.data.config import DataConfig
from specdistill.data.formats import SkipReport
from specdistill.data.token_store import StoreRows, TokenStore, open_store

TRUNCATE_MODES = ("left", "skip")


def select_rows(store: TokenStore, token_budget: int, truncate: str,
                context: int | None = None) -> tuple[StoreRows, SkipReport]:
    """The rows of `store` that fit `token_budget` tokens and the target's `context` (cut on the left where
    `truncate` allows), and the report of the build's skips plus this selection's."""
    if truncate not in TRUNCATE_MODES:
        raise ValueError(f"data.truncate={truncate!r}; valid: {', '.join(TRUNCATE_MODES)}")
    limit = token_budget if context is None else max_row_tokens(context, token_budget)
    if limit < 2:
        raise ValueError(f"trainer.token_budget={token_budget} (target context {context}): a row needs >= 2 tokens")
    report = store.build_report()
    lengths = store.lengths
    response = lengths - store.first_loss  # tokens from the first response token to the end
    if truncate == "skip":
        skip, reason = lengths > limit, "too_long"
    else:
        skip, reason = response > limit, "response_longer_than_pack"
    for line in store.lines[skip][:5]:  # examples name the input file's rows
        report.skip(reason, int(line), n=0)
    if skip.any():
        report.counts[reason] = report.counts.get(reason, 0) + int(skip.sum())
    keep = np.flatnonzero(~skip)
    starts = np.maximum(lengths[keep] - limit, 0).astype(np.int32)
    report.truncated = int((starts > 0).sum())
    report.truncated_tokens = int(starts.sum())
    report.rows_kept = len(keep)
    return StoreRows(store, keep, starts), report


def longest_row(store: TokenStore) -> tuple[int, int]:
    """(row id, tokens) of the store's longest row; (-1, 0) for an empty store."""
    if not len(store):
        return -1, 0
    i = int(np.argmax(store.lengths))
    return int(store.row_ids[i]), int(store.lengths[i])


def check_skipped(store: TokenStore, report: SkipReport, max_fraction: float, row_tokens: int, truncate: str,
                  context: int | None = None) -> None:
    """Stop before training when more than `max_fraction` of the file's rows were skipped, naming the count, the
    longest row and the settings that would keep them. row_tokens: the longest row a run takes (its pack size, or
    the target's `context` when that is shorter)."""
    if report.rows_seen == 0 or report.skipped <= max_fraction * report.rows_seen:
        return
    row_id, tokens = longest_row(store)
    limit = (f"the target's context is {context} tokens (rows of at most {max_row_tokens(context)})"
             if context is not None and context <= row_tokens else f"a pack holds trainer.token_budget={row_tokens}")
    where = f"; it is {store.where(row_id)}" if row_id >= 0 else ""
    bad = (" Rows skipped as bad_row failed to parse (data.bad_rows=skip): fix them, the first errors are listed."
           if report.counts.get("bad_row") else "")
    raise ValueError(
        f"{report.summary()}: {report.skipped} of {report.rows_seen} rows ({report.skipped / report.rows_seen:.1%}) "
        f"would be skipped, more than data.max_skipped_fraction={max_fraction:g}.{bad} The longest row is row {row_id}"
        f" ({tokens} tokens) and {limit} (data.truncate={truncate}){where}. Raise trainer.token_budget (32768 per "
        "GPU in production), set data.truncate=left to cut long prompts on the left, or raise "
        "data.max_skipped_fraction to train on the rest anyway")


def target_context(target_dir: str | Path) -> int | None:
    """max_position_embeddings of the checkpoint in `target_dir` (text_config's for multimodal wrappers); None
    when the directory holds a tokenizer only."""
    path = Path(target_dir) / "config.json"
    if not path.is_file():
        return None
    raw = json.loads(path.read_text())
    return (raw.get("text_config") or raw).get("max_position_embeddings") or raw.get("max_position_embeddings")


def load_selected(path, target_dir, cache_dir, token_budget: int, cfg: DataConfig,
                  progress: bool = True) -> tuple[StoreRows, SkipReport, TokenStore]:
    """A data file's rows as a run reads them: the token store (built once, specdistill/data/token_store.py, with
    the tokenizer, chat template and generation_config.json of `target_dir`), the rows that fit `token_budget` and
    the target's context per `cfg.truncate`, and the skip report."""
    store = open_store(path, target_dir, cache_dir, workers=cfg.tokenize_workers, progress=progress, cfg=cfg)
    rows, report = select_rows(store, token_budget, cfg.truncate, target_context(target_dir))
    return rows, report, store
