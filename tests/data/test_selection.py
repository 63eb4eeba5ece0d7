"""Rows longer than a pack: cut on the left (response kept) or skipped, always counted; too many skips stop the run."""

import json

import pytest

from specdistill.data.selection import check_skipped, select_rows
from specdistill.data.token_store import open_store
from specdistill.launch.tokenizer import save_tokenizer, workload_tokenizer


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("selection")
    (root / "tok").mkdir()
    save_tokenizer(workload_tokenizer(), root / "tok")
    rows = [{"input_ids": list(range(10, 10 + n)), "loss_mask": [0] * (n - r) + [1] * r}
            for n, r in ((8, 3), (20, 4), (40, 5), (30, 25))]
    path = root / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return open_store(path, root / "tok", root / "cache", workers=1, progress=False)


def test_left_truncation_keeps_the_response_and_the_last_prompt_tokens(store):
    rows, report = select_rows(store, token_budget=16, truncate="left")
    assert rows.row_ids.tolist() == [0, 1, 2]  # row 3's 25-token response cannot fit a 16-token pack
    cut = rows[1]
    assert list(cut.input_ids) == list(range(10 + 4, 10 + 20)) and sum(cut.loss_mask) == 4
    assert rows.num_tokens.tolist() == [8, 16, 16]
    assert report.counts == {"response_longer_than_pack": 1} and report.examples["response_longer_than_pack"] == [3]
    assert (report.truncated, report.truncated_tokens, report.rows_kept) == (2, 4 + 24, 3)


def test_skip_mode_counts_every_long_row(store):
    rows, report = select_rows(store, token_budget=16, truncate="skip")
    assert rows.row_ids.tolist() == [0] and report.counts == {"too_long": 3} and report.truncated == 0


def test_too_many_skips_stop_before_training_naming_the_longest_row_and_the_settings(store):
    _, report = select_rows(store, token_budget=16, truncate="skip")
    with pytest.raises(ValueError) as e:
        check_skipped(store, report, max_fraction=0.01, row_tokens=16, truncate="skip")
    msg = str(e.value)
    for part in ("3 of 4 rows (75.0%)", "data.max_skipped_fraction=0.01", "row 2 (40 tokens)", "line 3 (row 2)",
                 "trainer.token_budget=16", "data.truncate=left"):
        assert part in msg, (part, msg)
    check_skipped(store, report, max_fraction=0.75, row_tokens=16, truncate="skip")  # allowed: no error


def test_unknown_truncate_mode_lists_the_valid_ones(store):
    with pytest.raises(ValueError, match="data.truncate='right'; valid: left, skip"):
        select_rows(store, 16, "right")


def test_rows_cut_to_the_context_are_rows_the_vllm_backend_takes(tmp_path, monkeypatch):
    """trainer.token_budget >= the target's context with data.truncate=left: rows are kept to context - 1 tokens (the
    one rule, core.vllm_engine.max_row_tokens), which the vLLM feature backend, built as the trainer builds it
    (max_row_tokens = min(context, token_budget)), accepts; a row of exactly the context it would refuse."""
    from transformers import LlamaConfig

    from specdistill.core.contract import FeatureSpec, TokenizedRow
    from specdistill.data.config import DataConfig
    from specdistill.data.selection import load_selected

    context = 64
    target = tmp_path / "target"
    target.mkdir()
    save_tokenizer(workload_tokenizer(), target)
    LlamaConfig(vocab_size=4096, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, max_position_embeddings=context).save_pretrained(target)
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"input_ids": list(range(10, 10 + n)), "loss_mask": [0] * (n - 5) + [1] * 5})
                            + "\n" for n in (context, context + 16, 20)))
    rows, report, _ = load_selected(path, target, tmp_path / "cache", min(context, 4096), DataConfig(),
                                    progress=False)
    assert rows.num_tokens.tolist() == [context - 1, context - 1, 20] and report.truncated == 2
    vllm_backend = pytest.importorskip("specdistill.feature_server.vllm_backend")
    from vllm.platforms import current_platform

    started = {}
    monkeypatch.setattr("vllm.LLM", lambda **kwargs: started.update(kwargs) or object())  # no engine needed
    backend = vllm_backend.VLLMBackend(str(target), FeatureSpec((1,)), device=current_platform.device_type,
                                       dtype="float32", max_row_tokens=min(context, 4096))
    assert backend.max_model_len == started["max_model_len"] == context  # rounding up stops at the context
    backend._check_rows(list(rows))
    with pytest.raises(ValueError, match="row 0: 64 tokens"):
        backend._check_rows([TokenizedRow(0, (1,) * context, (0,) * (context - 1) + (1,))])
