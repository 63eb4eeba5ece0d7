"""Which rows of a token store a run trains on, given its pack size: the settings applied when the store is read.

The target prefills a row whole, so a row must fit its context (context - 1 tokens:
`specdistill.core.vllm_engine.max_row_tokens`); a pack holds `trainer.token_budget` of the positions rows ship. A run
whose drafters read whole rows ships every position, so a row must fit a pack too. A windowed-only run (`window`:
the DFlash family's sliding window) ships a row from its first response token - window (core/contract.py): its
rows may be longer than a pack, as long as that suffix (min(row, window + response)) fits one. A row that does not
fit: `data.truncate` says what happens:
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


def select_rows(store: TokenStore, token_budget: int, truncate: str, context: int | None = None,
                window: int | None = None) -> tuple[StoreRows, SkipReport]:
    """The rows of `store` whose shipped positions fit `token_budget` and that fit the target's `context` (cut on the
    left where `truncate` allows), and the report of the build's skips plus this selection's. window: the positions
    before the first response token a windowed-only run ships (module docstring); None: whole rows ship."""
    if truncate not in TRUNCATE_MODES:
        raise ValueError(f"data.truncate={truncate!r}; valid: {', '.join(TRUNCATE_MODES)}")
    whole = window is None
    limit = (token_budget if whole else None) if context is None else \
        max_row_tokens(context, token_budget if whole else None)  # the longest row prefilled (None: any)
    if min(token_budget, limit or token_budget) < 2:
        raise ValueError(f"trainer.token_budget={token_budget} (target context {context}): a row needs >= 2 tokens")
    report = store.build_report()
    lengths = store.lengths
    response = lengths - store.first_loss  # tokens from the first response token to the end
    shipped = lengths if whole else np.minimum(lengths, response + window)
    too_long = (lengths > limit) if limit is not None else np.zeros(len(lengths), dtype=bool)
    if truncate == "skip":
        skip, reason = too_long | (shipped > token_budget), "too_long"
    else:
        skip, reason = response > min(token_budget, limit or token_budget), "response_longer_than_pack"
    for line in store.lines[skip][:5]:  # examples name the input file's rows
        report.skip(reason, int(line), n=0)
    if skip.any():
        report.counts[reason] = report.counts.get(reason, 0) + int(skip.sum())
    keep = np.flatnonzero(~skip)
    # Cut on the left: to the prefill limit, and where the shipped suffix is longer than a pack, to a pack (a
    # windowed row cut to token_budget tokens ships at most that many).
    cut_to = np.full(len(keep), limit if limit is not None else np.iinfo(np.int64).max, dtype=np.int64)
    cut_to = np.where(shipped[keep] > token_budget, np.minimum(cut_to, token_budget), cut_to)
    starts = np.maximum(lengths[keep] - cut_to, 0).astype(np.int32)
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


def load_selected(path, target_dir, cache_dir, token_budget: int, cfg: DataConfig, progress: bool = True,
                  window: int | None = None) -> tuple[StoreRows, SkipReport, TokenStore]:
    """A data file's rows as a run reads them: the token store (built once, specdistill/data/token_store.py, with
    the tokenizer, chat template and generation_config.json of `target_dir`), the rows whose shipped positions fit
    `token_budget` (window: select_rows) and that fit the target's context per `cfg.truncate`, and the skip
    report."""
    store = open_store(path, target_dir, cache_dir, workers=cfg.tokenize_workers, progress=progress, cfg=cfg)
    rows, report = select_rows(store, token_budget, cfg.truncate, target_context(target_dir), window)
    return rows, report, store
