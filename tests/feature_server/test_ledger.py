"""SampleLedger: the trainer side's exactly-once bookkeeping and its checks on every sample (no processes)."""

from dataclasses import replace

import pytest
import torch

from specdistill.core.contract import TokenizedRow
from specdistill.feature_server.ledger import FeatureWorkerError, SampleLedger
from specdistill.feature_server.shm_transport import Received
from tests.feature_server.rows import HIDDEN, LAYERS, SPEC, make_rows


def _ledger():
    rows = make_rows(4)
    ledger = SampleLedger(SPEC, rows)
    return rows, ledger


def _received(row: TokenizedRow, worker: int, hidden_TLD=None, hidden_scale_TL=None) -> Received:
    if hidden_TLD is None:
        hidden_TLD = torch.zeros(row.num_tokens, len(SPEC.layer_ids), HIDDEN)
    tensors = {"input_ids_T": torch.tensor(row.input_ids), "loss_mask_T": torch.tensor(row.loss_mask).bool(),
               "hidden_TLD": hidden_TLD}
    if hidden_scale_TL is not None:
        tensors["hidden_scale_TL"] = hidden_scale_TL
    return Received("data", worker, row.row_id, {}, tensors)


def test_ledger_rejects_samples_that_break_the_contract():
    rows, ledger = _ledger()
    assert [r.row_id for r in ledger.assign(0, 2)] == [rows[0].row_id, rows[1].row_id]
    with pytest.raises(FeatureWorkerError, match="before any worker was ready"):
        ledger.accept(_received(rows[0], 0))
    ledger.ready(0, {"num_hidden_layers": LAYERS, "hidden_size": HIDDEN})
    stranger = TokenizedRow(5, rows[0].input_ids, rows[0].loss_mask)
    with pytest.raises(FeatureWorkerError, match="row 5 is not in this rank's rows"):
        ledger.accept(_received(stranger, 0))
    with pytest.raises(ValueError, match=rf"row {rows[0].row_id}: hidden states of layers .* have shape"):
        ledger.accept(_received(rows[0], 0, torch.zeros(rows[0].num_tokens, 1, HIDDEN)))
    with pytest.raises(ValueError, match=rf"row {rows[0].row_id}: hidden states of layers .* are torch.bfloat16, "
                                         "expected torch.float32"):
        ledger.accept(_received(rows[0], 0, torch.zeros(rows[0].num_tokens, 3, HIDDEN, dtype=torch.bfloat16)))
    int_mask = _received(rows[0], 0)
    int_mask.tensors["loss_mask_T"] = int_mask.tensors["loss_mask_T"].long()
    with pytest.raises(FeatureWorkerError, match="loss mask is torch.int64"):
        ledger.accept(int_mask)
    tampered = TokenizedRow(rows[1].row_id, (rows[1].input_ids[0] + 1,) + rows[1].input_ids[1:], rows[1].loss_mask)
    with pytest.raises(FeatureWorkerError, match="tokens or loss mask differ"):
        ledger.accept(_received(tampered, 0))
    assert ledger.accept(_received(rows[0], 0)) is not None
    with pytest.raises(FeatureWorkerError, match=rf"reported done, but rows \[{rows[1].row_id}\]"):
        ledger.finished(0)


def test_fp8_samples_must_carry_a_scale_per_position_and_layer():
    spec = replace(SPEC, hidden_dtype="float8_e4m3fn")
    rows = make_rows(2)
    ledger = SampleLedger(spec, rows)
    ledger.ready(0, {"num_hidden_layers": LAYERS, "hidden_size": HIDDEN})
    ledger.assign(0, 2)
    fp8 = lambda row: torch.zeros(row.num_tokens, 3, HIDDEN, dtype=torch.float8_e4m3fn)  # noqa: E731
    with pytest.raises(FeatureWorkerError, match=rf"row {rows[0].row_id} carries fields .*expected .*hidden_scale_TL"):
        ledger.accept(_received(rows[0], 0, fp8(rows[0])))
    with pytest.raises(ValueError, match=rf"row {rows[0].row_id}: scales of its hidden states of layers .* have shape "
                                         rf"\({rows[0].num_tokens}, 2\), expected \({rows[0].num_tokens}, 3\)"):
        ledger.accept(_received(rows[0], 0, fp8(rows[0]), torch.ones(rows[0].num_tokens, 2)))
    with pytest.raises(ValueError, match=rf"row {rows[0].row_id}: hidden states of layers .* are torch.float32"):
        ledger.accept(_received(rows[0], 0, None, torch.ones(rows[0].num_tokens, 3)))
    sample = ledger.accept(_received(rows[1], 0, fp8(rows[1]), torch.ones(rows[1].num_tokens, 3)))
    assert sample.hidden_TLD.dtype == torch.float8_e4m3fn and sample.hidden_scale_TL.shape == (rows[1].num_tokens, 3)
    with pytest.raises(ValueError, match=rf"row {rows[1].row_id}: carries scales of its hidden states, the spec ships "
                                         "float32"):
        replace(sample, hidden_TLD=sample.hidden_TLD.float()).check(SPEC, HIDDEN)  # nor a float32 stream's sample

def test_ledger_reissues_a_dead_workers_rows_and_drops_late_duplicates():
    rows, ledger = _ledger()
    ledger.ready(0, {"num_hidden_layers": LAYERS, "hidden_size": HIDDEN})
    ledger.assign(0, 2)
    ledger.assign(1, 2)
    assert ledger.accept(_received(rows[0], 0)) is not None
    assert ledger.worker_died(0) == [rows[1].row_id]  # in flight with the dead worker -> back in the queue
    assert list(ledger.pending) == [rows[1].row_id]
    assert [r.row_id for r in ledger.assign(1, 1)] == [rows[1].row_id]
    for row in rows[1:]:
        assert ledger.accept(_received(row, 1)) is not None
    assert ledger.complete and ledger.reissued == 1
    assert ledger.accept(_received(rows[1], 0)) is None  # the dead worker's late copy
    assert ledger.duplicates_dropped == 1 and len(ledger.done) == 4


def test_a_late_copy_from_an_earlier_stream_is_dropped_not_delivered():
    """Row ids recur every epoch of a run's server: a copy extracted for stream 0 that arrives during stream 1 is
    a duplicate of stream 0's delivery, never stream 1's sample."""
    rows = make_rows(2)
    ledger = SampleLedger(SPEC, rows, stream=1)
    ledger.ready(0, {"num_hidden_layers": LAYERS, "hidden_size": HIDDEN})
    ledger.assign(0, 2)
    stale = _received(rows[0], 0)
    stale.info["stream"] = 0
    assert ledger.accept(stale) is None and ledger.duplicates_dropped == 1 and not ledger.done
    current = _received(rows[0], 0)
    current.info["stream"] = 1
    assert ledger.accept(current) is not None and ledger.done == {rows[0].row_id}
