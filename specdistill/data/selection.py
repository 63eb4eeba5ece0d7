"""Which rows of a token store a run trains on, given its pack size: the settings applied when the store is read.

A row longer than a pack (`trainer.token_budget` tokens) cannot be packed whole. `data.truncate` says what happens:
  left  keep the response and as many of the last prompt tokens as fit (the prompt is cut on the left; the target
        prefills the cut row, so its states and the drafter's context agree); counted. A row whose response alone
        is longer than the pack is skipped (counted as response_longer_than_pack).
  skip  skip the row (counted as too_long).
A run whose skipped rows exceed `data.max_skipped_fraction` of the file stops before training (`check_skipped`):
a silently biased sample (only the short prompts trained) is worse than an error.
"""

import numpy as np

from specdistill.data.config import DataConfig
from specdistill.data.formats import SkipReport
from specdistill.data.token_store import StoreRows, TokenStore, open_store

TRUNCATE_MODES = ("left", "skip")


def select_rows(store: TokenStore, token_budget: int, truncate: str) -> tuple[StoreRows, SkipReport]:
    """The rows of `store` that fit `token_budget` tokens (cut on the left where `truncate` allows), and the
    report of the build's skips plus this selection's."""
    if truncate not in TRUNCATE_MODES:
        raise ValueError(f"data.truncate={truncate!r}; valid: {', '.join(TRUNCATE_MODES)}")
    if token_budget < 2:
        raise ValueError(f"trainer.token_budget={token_budget}: a pack needs >= 2 tokens")
    report = store.build_report()
    lengths = store.lengths
    response = lengths - store.first_loss  # tokens from the first response token to the end
    too_long = lengths > token_budget
    if truncate == "skip":
        skip = too_long
        reason = "too_long"
    else:
        skip = response > token_budget
        reason = "response_longer_than_pack"
    for row_id in store.row_ids[skip][:5]:
        report.skip(reason, int(row_id), n=0)
    if skip.any():
        report.counts[reason] = report.counts.get(reason, 0) + int(skip.sum())
    keep = np.flatnonzero(~skip)
    starts = np.maximum(lengths[keep] - token_budget, 0).astype(np.int32)
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
    limit = (f"the target's context is {context} tokens" if context is not None and context <= row_tokens
             else f"a pack holds trainer.token_budget={row_tokens}")
    raise ValueError(
        f"{report.summary()}: {report.skipped} of {report.rows_seen} rows ({report.skipped / report.rows_seen:.1%}) "
        f"would be skipped, more than data.max_skipped_fraction={max_fraction:g}. The longest row is row {row_id} "
        f"({tokens} tokens) and {limit} (data.truncate={truncate}). Raise trainer.token_budget (32768 per GPU in "
        "production), set data.truncate=left to cut long prompts on the left, or raise data.max_skipped_fraction "
        "to train on the rest anyway")


def load_selected(path, tokenizer_dir, cache_dir, token_budget: int, cfg: DataConfig,
                  progress: bool = True) -> tuple[StoreRows, SkipReport, TokenStore]:
    """A data file's rows as a run reads them: the token store (built once, specdistill/data/token_store.py), the rows that
    fit `token_budget` per `cfg.truncate`, and the skip report."""
    store = open_store(path, tokenizer_dir, cache_dir, workers=cfg.tokenize_workers, progress=progress)
    rows, report = select_rows(store, token_budget, cfg.truncate)
    return rows, report, store
