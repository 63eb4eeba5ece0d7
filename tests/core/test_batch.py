import torch

from specdistill.core.batch import pack_stream
from specdistill.core.contract import FeatureSample


def sample(row_id, n, L=2, D=4):
    return FeatureSample(row_id, torch.arange(n), torch.arange(n) >= n // 2, torch.full((n, L, D), float(row_id)))


def test_packs_keep_rows_whole_and_restart_positions():
    packs = list(pack_stream([sample(0, 5), sample(1, 4), sample(2, 6), sample(3, 20)], token_budget=10, spec=(1, 4)))
    assert [p.row_ids for p in packs] == [(0, 1), (2,), (3,)]  # an over-budget row gets a pack of its own
    first = packs[0]
    assert first.document_ids_T.tolist() == [0] * 5 + [1] * 4
    assert first.position_ids_T.tolist() == list(range(5)) + list(range(4))
    assert first.layers([4]).shape == (9, 1, 4)
    assert torch.equal(first.layers([4])[5:, 0, 0], torch.ones(4))
