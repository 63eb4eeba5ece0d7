"""The token store: built once (in parallel) from JSONL, Parquet or Arrow, equal to the per-row parser, mapped on
every later start, never reused for another file or tokenizer, bad input named by file, line and field."""

import json
import shutil

import numpy as np
import pytest

import specdistill.data.formats as formats
import specdistill.data.token_store as token_store
from specdistill.data.formats import DatasetError, load_rows
from specdistill.data.token_store import open_store
from specdistill.launch.tokenizer import as_hf, save_tokenizer, workload_tokenizer


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokenizer")
    save_tokenizer(workload_tokenizer(), path)
    return path


@pytest.fixture(scope="module")
def tok():
    return as_hf(workload_tokenizer())


def chat(i: int) -> dict:
    return {"messages": [{"role": "system", "content": "Return JSON."},
                         {"role": "user", "content": f"black trail shoes size {i} " * (1 + i % 9)},
                         {"role": "assistant", "content": json.dumps({"size": i, "sort": "price_asc"})}],
            "stage": ("search_queries", "filter_selection")[i % 2]}


def write_jsonl(path, rows):
    path.write_text("".join((json.dumps(r) if r is not None else "") + "\n" for r in rows))
    return path


def same_rows(a, b) -> bool:
    return [(r.row_id, tuple(r.input_ids), tuple(r.loss_mask)) for r in a] == \
           [(r.row_id, tuple(r.input_ids), tuple(r.loss_mask)) for r in b]


def test_store_rows_equal_the_row_parser_across_chunks_and_processes(tmp_path, tok_dir, tok, monkeypatch):
    """A file cut into many chunks and tokenized by 2 spawned processes reads back exactly as the per-row parser
    gives it: same row ids (line indexes, blank lines counted), tokens, masks; stages kept; skips counted."""
    rows = [chat(i) if i % 11 else None for i in range(120)] + [{"input_ids": [1, 2], "loss_mask": [0, 0]}]
    path = write_jsonl(tmp_path / "train.jsonl", rows)
    monkeypatch.setattr(formats, "JSONL_CHUNK_BYTES", 2000)
    assert len(formats.chunks(path)) > 5
    store = open_store(path, tok_dir, tmp_path / "cache", workers=2, progress=False)
    expected, _ = load_rows(path, tok, max_tokens=10**9)
    assert same_rows(store.rows(), expected) and store.meta["build_processes"] == 2
    assert store.stages_by_row_id()[1] == "filter_selection" and store.stages_by_row_id()[2] == "search_queries"
    report = store.build_report()
    assert report.rows_seen == 120 - 11 + 1 and report.counts == {"no_response_tokens": 1}
    assert report.examples == {"no_response_tokens": [120]}


def test_parquet_and_arrow_inputs_read_like_jsonl(tmp_path, tok_dir, tok):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = [chat(i) for i in range(30)]
    expected, _ = load_rows(write_jsonl(tmp_path / "rows.jsonl", rows), tok, max_tokens=10**9)
    # Chat rows in Parquet (row groups of 7), and pre-tokenized rows in Arrow IPC: the vectorised path.
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "rows.parquet", row_group_size=7)
    table = pa.table({"input_ids": [list(r.input_ids) for r in expected],
                      "loss_mask": [list(r.loss_mask) for r in expected], "stage": [r["stage"] for r in rows]})
    with pa.ipc.new_file(str(tmp_path / "rows.arrow"), table.schema) as writer:
        for batch in table.to_batches(max_chunksize=8):
            writer.write_batch(batch)
    for name in ("rows.parquet", "rows.arrow"):
        store = open_store(tmp_path / name, tok_dir, tmp_path / "cache", workers=2, progress=False)
        assert same_rows(store.rows(), expected), name
        assert store.stages_by_row_id()[3] == "filter_selection"


def test_a_later_start_maps_the_store_and_never_tokenizes(tmp_path, tok_dir, monkeypatch):
    path = write_jsonl(tmp_path / "train.jsonl", [chat(i) for i in range(10)])
    first = open_store(path, tok_dir, tmp_path / "cache", workers=1, progress=False)

    def no_build(*args, **kwargs):
        raise AssertionError("re-tokenized a file whose store exists")

    monkeypatch.setattr(token_store, "_build", no_build)
    again = open_store(path, tok_dir, tmp_path / "cache", workers=1, progress=False)
    assert again.dir == first.dir and same_rows(again.rows(), first.rows())
    assert isinstance(again.tokens, np.memmap)  # mapped, not read into the process


def test_a_store_is_never_reused_for_another_file_or_tokenizer(tmp_path, tok_dir):
    path = write_jsonl(tmp_path / "train.jsonl", [chat(i) for i in range(10)])
    cache = tmp_path / "cache"
    first = open_store(path, tok_dir, cache, workers=1, progress=False).dir
    # Same size, same mtime, other bytes: the memoised digest must not hide the change (ctime moves).
    stat = path.stat()
    text = path.read_text()
    path.write_text(text.replace("price_asc", "price_dsc"))
    import os

    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert path.stat().st_size == stat.st_size and path.stat().st_mtime_ns == stat.st_mtime_ns
    changed = open_store(path, tok_dir, cache, workers=1, progress=False)
    assert changed.dir != first and "dsc" in as_hf(workload_tokenizer()).decode(list(changed.rows()[0].input_ids))
    # Another chat template: another store.
    other_tok = tmp_path / "other-tokenizer"
    shutil.copytree(tok_dir, other_tok)
    config = json.loads((other_tok / "tokenizer_config.json").read_text())
    config["chat_template"] = config["chat_template"].replace("'\\n'", "'\\n\\n'")
    (other_tok / "tokenizer_config.json").write_text(json.dumps(config))
    templated = open_store(path, other_tok, cache, workers=1, progress=False)
    assert templated.dir not in (first, changed.dir)
    assert templated.rows()[0].input_ids != changed.rows()[0].input_ids


def test_bad_rows_are_named_by_file_and_line_from_any_chunk(tmp_path, tok_dir, monkeypatch):
    rows = [chat(i) for i in range(60)]
    rows[47] = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": 7}]}
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    monkeypatch.setattr(formats, "JSONL_CHUNK_BYTES", 1500)
    with pytest.raises(DatasetError, match=r"bad.jsonl, line 48 \(row 47\), field 'messages\[1\].content': "
                                           r"expected a string, got int 7"):
        open_store(path, tok_dir, tmp_path / "cache", workers=2, progress=False)
    write_jsonl(path, [chat(0), {"input_ids": [1, 10**6], "loss_mask": [0, 1]}])
    with pytest.raises(DatasetError, match=r"line 2 \(row 1\): token id 1000000 outside the tokenizer's vocab"):
        open_store(path, tok_dir, tmp_path / "cache", workers=1, progress=False)
    assert not list((tmp_path / "cache" / "tokens").glob(".*building*")), "a failed build left its temp dir"


def test_bad_pretokenized_parquet_rows_are_named(tmp_path, tok_dir):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    table = pa.table({"input_ids": [[1, 2, 3], [4, 5, 6]], "loss_mask": [[0, 1, 1], [0, 1]]})
    pq.write_table(table, tmp_path / "bad.parquet")
    with pytest.raises(DatasetError, match=r"bad.parquet, row 1, field 'loss_mask': expected the same length as "
                                           r"input_ids \(3\), got length 2"):
        open_store(tmp_path / "bad.parquet", tok_dir, tmp_path / "cache", workers=1, progress=False)
    with pytest.raises(DatasetError, match=r"unknown data file type '.csv'"):
        open_store(write_jsonl(tmp_path / "rows.csv", [chat(0)]), tok_dir, tmp_path / "cache", progress=False)
