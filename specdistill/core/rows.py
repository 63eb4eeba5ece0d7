"""Dataset rows by position, without holding them: the index the trainer, the ledger and the packer read.

A dataset of 847k rows x 5k tokens does not fit a process as Python objects (~44 bytes a token). `Rows` is what
every consumer takes instead of a list: `row_ids` and `num_tokens` are numpy arrays (the index), and a row's tokens
are built only when `rows[i]` asks for them (specdistill/data/token_store.py reads them from a memory-mapped token file). A
plain list of TokenizedRows (tests, small held-out sets) is wrapped by `as_rows`.

Legend: N = rows in this view.
"""

from collections.abc import Sequence

import numpy as np

from specdistill.core.contract import TokenizedRow


class Rows(Sequence):
    """An ordered, immutable selection of dataset rows. Subclasses implement `_row(i)` and `take(positions)`."""

    row_ids: np.ndarray  # [N] int64, unique
    num_tokens: np.ndarray  # [N] int64

    def __len__(self) -> int:
        return len(self.row_ids)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self.take(np.arange(len(self))[index])
        if not -len(self) <= index < len(self):
            raise IndexError(f"row position {index} out of range for {len(self)} rows")
        return self._row(int(index) % len(self))

    def _row(self, i: int) -> TokenizedRow:
        raise NotImplementedError

    def take(self, positions: np.ndarray) -> "Rows":
        raise NotImplementedError

    def position_of(self, row_id: int) -> int:
        """This view's position of `row_id` (KeyError if absent): a binary search, no per-row dict."""
        if not hasattr(self, "_sorted"):
            order = np.argsort(self.row_ids, kind="stable")
            self._sorted = (self.row_ids[order], order)
        ids, order = self._sorted
        k = int(np.searchsorted(ids, row_id))
        if k == len(ids) or ids[k] != row_id:
            raise KeyError(row_id)
        return int(order[k])

    def by_id(self, row_id: int) -> TokenizedRow:
        return self._row(self.position_of(row_id))

    @property
    def first_response(self) -> np.ndarray:
        """[N] int64: each row's first response token (loss_mask 1); its length when it has none. What the positions
        a row ships start from (core/contract.py FeatureSpec.spans)."""
        if not hasattr(self, "_first_response"):
            self._first_response = np.array([next((i for i, m in enumerate(row.loss_mask) if m), row.num_tokens)
                                             for row in self], dtype=np.int64)
        return self._first_response

    def response_tokens(self) -> np.ndarray:
        """[N] int64: each row's response tokens (loss_mask 1)."""
        return np.array([sum(row.loss_mask) for row in self], dtype=np.int64)

    def response_token_counts(self, vocab_size: int) -> np.ndarray:
        """[vocab_size] int64: how often each token id is a response token (loss_mask 1) in these rows."""
        counts = np.zeros(vocab_size, dtype=np.int64)
        for row in self:
            ids = np.asarray(row.input_ids, dtype=np.int64)[np.asarray(row.loss_mask, dtype=bool)]
            counts += np.bincount(ids, minlength=vocab_size)[:vocab_size]
        return counts


class ListRows(Rows):
    """Rows held in memory (a list of TokenizedRow): for tests and small sets."""

    def __init__(self, rows: Sequence[TokenizedRow]):
        self._rows = list(rows)
        self.row_ids = np.array([r.row_id for r in self._rows], dtype=np.int64)
        self.num_tokens = np.array([r.num_tokens for r in self._rows], dtype=np.int64)

    def _row(self, i: int) -> TokenizedRow:
        return self._rows[i]

    def take(self, positions: np.ndarray) -> "ListRows":
        return ListRows([self._rows[int(p)] for p in positions])


def as_rows(rows: "Rows | Sequence[TokenizedRow]") -> Rows:
    return rows if isinstance(rows, Rows) else ListRows(rows)


def check_unique_ids(rows: Rows) -> None:
    ids, counts = np.unique(rows.row_ids, return_counts=True)
    if len(ids) != len(rows):
        raise ValueError(f"row id {int(ids[counts > 1][0])} appears twice in rows; row ids must be unique")
