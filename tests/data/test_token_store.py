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
from tests.files import write_jsonl


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


def same_rows(a, b) -> bool:
    return [(r.row_id, tuple(r.input_ids), tuple(r.loss_mask)) for r in a] == \
           [(r.row_id, tuple(r.input_ids), tuple(r.loss_mask)) for r in b]


def test_store_rows_equal_the_row_parser_across_chunks_and_processes(tmp_path, tok_dir, tok, monkeypatch):
    """A file cut into many chunks and tokenized by 2 spawned processes reads back exactly as the per-row parser
    gives it: same row ids (dense positions), source lines (blank lines counted), tokens, masks; stages kept; skips
    counted."""
    rows = [chat(i) if i % 11 else None for i in range(120)] + [{"input_ids": [1, 2], "loss_mask": [0, 0]}]
    path = write_jsonl(tmp_path / "train.jsonl", rows)
    monkeypatch.setattr(formats, "JSONL_CHUNK_BYTES", 2000)
    assert len(formats.chunks(path)) > 5
    store = open_store(path, tok_dir, tmp_path / "cache", workers=2, progress=False)
    expected, _ = load_rows(path, tok, max_tokens=10**9)
    assert same_rows(store.rows(), expected) and store.meta["build_processes"] == 2
    assert store.stages_by_row_id()[0] == "filter_selection" and store.stages_by_row_id()[1] == "search_queries"
    kept_lines = [i for i in range(120) if i % 11]  # the blank lines give no row; line 120 has no response
    assert store.lines.tolist() == kept_lines and set(store.turns.tolist()) == {2}
    assert store.where(1) == f"{path}, line 3 (row 2), messages[2]"
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


def test_a_copy_of_the_file_elsewhere_shares_the_store_and_is_named_as_the_user_gave_it(tmp_path, tok_dir):
    """Stores are keyed by content: another checkout's copy of a file maps the same store, and what the run reports
    (skips, row locations) names the copy it was given, not the file of the first build."""
    first_path = write_jsonl(tmp_path / "a" / "train.jsonl", [chat(i) for i in range(6)])
    first = open_store(first_path, tok_dir, tmp_path / "cache", workers=1, progress=False)
    copy = tmp_path / "b" / "train.jsonl"
    copy.parent.mkdir()
    shutil.copyfile(first_path, copy)
    again = open_store(copy, tok_dir, tmp_path / "cache", workers=1, progress=False)
    assert again.dir == first.dir
    assert again.source == str(copy) and again.build_report().path == str(copy)
    assert again.where(2).startswith(str(copy)) and first.where(2).startswith(str(first_path))


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
                                           r"expected a string, a list of content parts or null, got int 7"):
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


def conversation(i: int) -> dict:
    """A multi-turn chat row: 1 + i % 3 assistant turns, each one row of the store with data.loss_on=all."""
    messages = [{"role": "system", "content": "Return JSON."}]
    for t in range(1 + i % 3):
        messages += [{"role": "user", "content": f"shoes size {i + t}"},
                     {"role": "assistant", "content": json.dumps({"size": i + t})}]
    return {"messages": messages, "stage": "search_queries"}


def test_multi_turn_rows_give_one_store_row_per_trained_turn(tmp_path, tok_dir, tok, monkeypatch):
    from specdistill.data.config import DataConfig

    rows = [conversation(i) for i in range(40)]
    rows[7] = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": 7}]}  # bad
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    monkeypatch.setattr(formats, "JSONL_CHUNK_BYTES", 1500)
    cfg = DataConfig(bad_rows="skip")
    store = open_store(path, tok_dir, tmp_path / "cache", workers=2, progress=False, cfg=cfg)
    expected, report = load_rows(path, tok, 10**9, cfg)
    assert same_rows(store.rows(), expected)
    turns = [1 + i % 3 for i in range(40) if i != 7]
    assert len(store) == sum(turns) and store.meta["input_rows"] == 40
    assert store.lines.tolist() == [i for i in range(40) if i != 7 for _ in range(1 + i % 3)]
    assert store.turns.tolist()[:6] == [2, 2, 4, 2, 4, 6]  # the assistant message each row trains
    built = store.build_report()
    assert built.counts == {"bad_row": 1} and built.examples == {"bad_row": [7]} and built.rows_seen == len(store) + 1
    assert "line 8 (row 7), field 'messages[1].content'" in built.errors[0] and built.errors == report.errors
    last = open_store(path, tok_dir, tmp_path / "cache", workers=1, progress=False,
                      cfg=DataConfig(bad_rows="skip", loss_on="last"))
    assert len(last) == 39 and last.turns.tolist()[:3] == [2, 4, 6]


def test_the_key_holds_every_setting_that_changes_tokens(tmp_path, tok_dir):
    from specdistill.data.config import DataConfig

    path = write_jsonl(tmp_path / "chat.jsonl", [conversation(i) for i in range(4)])
    cache = tmp_path / "cache"
    dirs = {open_store(path, tok_dir, cache, workers=1, progress=False, cfg=cfg).dir
            for cfg in (DataConfig(), DataConfig(loss_on="last"), DataConfig(bad_rows="skip"),
                        DataConfig(chat_template_kwargs={"enable_thinking": False}))}
    assert len(dirs) == 4
    # generation_config.json's eos ids end responses: another file, another store
    other = tmp_path / "other-tokenizer"
    shutil.copytree(tok_dir, other)
    (other / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))
    assert open_store(path, other, cache, workers=1, progress=False).dir not in dirs
    with pytest.raises(ValueError, match="data.loss_on='first'; valid: all, last"):
        open_store(path, tok_dir, cache, progress=False, cfg=DataConfig(loss_on="first"))


def test_a_bad_pretokenized_parquet_row_is_skipped_with_bad_rows_skip(tmp_path, tok_dir):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    from specdistill.data.config import DataConfig

    table = pa.table({"input_ids": [[1, 2, 3], [4, 5, 6], [7, 8]], "loss_mask": [[0, 1, 1], [0, 1], [0, 1]]})
    pq.write_table(table, tmp_path / "rows.parquet")
    store = open_store(tmp_path / "rows.parquet", tok_dir, tmp_path / "cache", workers=1, progress=False,
                       cfg=DataConfig(bad_rows="skip"))
    assert store.lines.tolist() == [0, 2] and store.build_report().counts == {"bad_row": 1}


def test_one_row_group_parquet_is_read_in_pieces_spread_over_processes(tmp_path, tok_dir, tok, monkeypatch):
    """A Parquet file written as one row group (pyarrow's default up to ~1M rows) is cut into pieces that one
    reader decodes once and hands to the tokenizing processes; an Arrow file of one record batch into slices.
    Both read back as the per-row parser reads the JSONL."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = [chat(i) for i in range(40)]
    expected, _ = load_rows(write_jsonl(tmp_path / "rows.jsonl", rows), tok, max_tokens=10**9)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "one.parquet")  # one row group
    table = pa.table({"input_ids": [list(r.input_ids) for r in expected],
                      "loss_mask": [list(r.loss_mask) for r in expected]})
    with pa.ipc.new_file(str(tmp_path / "one.arrow"), table.schema) as writer:
        writer.write_table(table)  # one record batch
    monkeypatch.setattr(formats, "PIECE_BYTES", 1200)  # the pieces the processes share (main process only)
    pieces = formats.chunks(tmp_path / "one.parquet")
    assert pq.ParquetFile(tmp_path / "one.parquet").metadata.num_row_groups == 1 and len(pieces) > 4
    assert all(p.streamed for p in pieces) and [p.first_row for p in pieces] == [p.rows[0] for p in pieces]
    store = open_store(tmp_path / "one.parquet", tok_dir, tmp_path / "cache", workers=2, progress=False)
    assert same_rows(store.rows(), expected) and store.meta["build_processes"] == 2
    assert store.lines.tolist() == list(range(40)) and store.stages_by_row_id()[3] == "filter_selection"
    assert len(formats.chunks(tmp_path / "one.arrow")) > 4
    store = open_store(tmp_path / "one.arrow", tok_dir, tmp_path / "cache", workers=1, progress=False)
    assert same_rows(store.rows(), expected)
    assert [r for _, r, _ in formats.iter_rows(tmp_path / "one.parquet")] == rows  # one pass, in order


def test_a_shared_cache_never_removes_a_complete_store(tmp_path, tok_dir, monkeypatch):
    """Two builders that both got past the lock (flock local to each node): the second keeps the first's store
    (its readers' files stay) and drops its own; an incomplete leftover is replaced; no temporary dir is left."""
    path = write_jsonl(tmp_path / "train.jsonl", [chat(i) for i in range(6)])
    cache = tmp_path / "cache"
    store = open_store(path, tok_dir, cache, workers=1, progress=False)
    inode = (store.dir / "tokens.u32").stat().st_ino
    token_store._build(path, tok_dir, store.dir, 1, False, store.meta["settings"])  # a second node's builder
    assert (store.dir / "tokens.u32").stat().st_ino == inode
    assert [p.name for p in (cache / "tokens").iterdir() if p.name.startswith(".")] == [f".{store.dir.name}.lock"]
    other = write_jsonl(tmp_path / "other.jsonl", [chat(i) for i in range(3)])
    leftover = cache / "tokens" / token_store.store_key(other, tok_dir, cache)
    leftover.mkdir()
    (leftover / "tokens.u32").write_bytes(b"partial copy")  # no meta.json: incomplete
    assert len(open_store(other, tok_dir, cache, workers=1, progress=False)) == 3


def test_the_file_digest_memo_holds_across_nfs_clients(tmp_path, tok_dir, monkeypatch):
    """The memo is keyed by path, inode, size and times, not the device number, which differs on every NFS client
    of one file: a second node sharing the cache does not re-read the file."""
    import hashlib
    import os
    import types

    path = write_jsonl(tmp_path / "train.jsonl", [chat(i) for i in range(3)])
    memo = tmp_path / "cache" / "tokens" / "digests"
    digest = token_store.content_digest(path, memo)
    real_stat = os.stat

    def other_client(p, *args, **kwargs):
        st = real_stat(p, *args, **kwargs)
        if str(p) != str(path):
            return st
        fields = {k: getattr(st, k) for k in dir(st) if k.startswith("st_")}
        return types.SimpleNamespace(**{**fields, "st_dev": st.st_dev + 1})

    def no_read(*args):
        raise AssertionError("re-hashed a file whose digest is memoised")

    monkeypatch.setattr(token_store.os, "stat", other_client)
    monkeypatch.setattr(hashlib, "file_digest", no_read)
    assert token_store.content_digest(path, memo) == digest


def test_response_token_counts_are_counted_once_per_selection_and_kept_with_the_store(tmp_path, tok_dir, monkeypatch):
    """EAGLE-3's draft vocabulary counts: equal to counting row by row for any selection (left cuts, a cut into a
    response, a row twice), written once in the store directory and read back by a later start."""
    from specdistill.core.rows import ListRows
    from specdistill.data.selection import select_rows
    from specdistill.data.token_store import StoreRows, TokenStore

    path = write_jsonl(tmp_path / "train.jsonl", [chat(i) for i in range(30)])
    store = open_store(path, tok_dir, tmp_path / "cache", workers=1, progress=False)
    vocab = int(store.tokens.max()) + 5
    selected, report = select_rows(store, 40, "left")  # short packs: prompts cut on the left
    assert report.truncated > 0
    odd = StoreRows(store, np.array([3, 3, 7, 1]), np.array([0, int(store.first_loss[3]) + 1, 0, 2]))
    for rows in (selected, selected.take(np.arange(0, len(selected), 2)), odd):
        assert np.array_equal(rows.response_token_counts(vocab), ListRows(list(rows)).response_token_counts(vocab))
    cached = sorted(p.name for p in (store.dir / "counts").iterdir())
    assert cached == sorted(f"{r.selection_key(vocab)}.npy" for r in (selected, selected.take(
        np.arange(0, len(selected), 2)), odd))
    expected = selected.response_token_counts(vocab)

    def no_count(self, vocab_size):
        raise AssertionError("counted again: a later start must read the kept counts")

    monkeypatch.setattr(StoreRows, "_count_response_tokens", no_count)
    again, _ = select_rows(TokenStore(store.dir), 40, "left")  # a later start: a fresh process's store
    assert np.array_equal(again.response_token_counts(vocab), expected)
    assert again.take(np.arange(len(again))[::-1]).selection_key(vocab) == again.selection_key(vocab)  # any order


def test_arrow_chat_rows_and_arrow_structs_read_like_their_jsonl(tmp_path, tok_dir, tok):
    """Chat rows in an Arrow file read as their JSONL does, though Arrow gives every struct of a column all of the
    column's keys: a message without a key another message has gets it as null, which must not reach the
    template."""
    pa = pytest.importorskip("pyarrow")

    rows = [chat(i) for i in range(12)]
    rows[3]["messages"][0]["name"] = "system-prompt-v2"  # a key only one message has: the others get it as null
    expected, _ = load_rows(write_jsonl(tmp_path / "rows.jsonl", rows), tok, max_tokens=10**9)
    table = pa.Table.from_pylist(rows)
    with pa.ipc.new_file(str(tmp_path / "rows.arrow"), table.schema) as writer:
        writer.write_table(table)
    assert [obj for _, obj, _ in formats.iter_rows(tmp_path / "rows.arrow")] == rows
    store = open_store(tmp_path / "rows.arrow", tok_dir, tmp_path / "cache", workers=1, progress=False)
    assert same_rows(store.rows(), expected)


def test_a_bad_pretokenized_row_in_a_piece_of_a_record_batch_is_named_right(tmp_path, tok_dir, monkeypatch):
    """One record batch cut into pieces: each piece checks its own rows (a piece's list values are the whole
    batch's), so a bad token or a short loss_mask is named at its own row, in whichever piece holds it."""
    pa = pytest.importorskip("pyarrow")

    ids = [[1, 2, 3, 4, 5, 6, 7, 8] for _ in range(300)]
    mask = [[0, 0, 0, 0, 1, 1, 1, 1] for _ in range(300)]
    ids[250][3] = 10**6
    mask[120] = mask[120][:-1]

    def write(name, ids, mask):
        table = pa.table({"input_ids": ids, "loss_mask": mask})
        with pa.ipc.new_file(str(tmp_path / name), table.schema) as writer:
            writer.write_table(table)  # one record batch
        return tmp_path / name

    monkeypatch.setattr(formats, "PIECE_BYTES", 2000)
    bad_mask = write("mask.arrow", ids, mask)
    assert len(formats.chunks(bad_mask)) > 4
    with pytest.raises(DatasetError, match=r"mask.arrow, row 120, field 'loss_mask'"):
        open_store(bad_mask, tok_dir, tmp_path / "cache", workers=1, progress=False)
    bad_token = write("token.arrow", ids, [[0, 0, 0, 0, 1, 1, 1, 1]] * 300)
    with pytest.raises(DatasetError, match=r"token.arrow, row 250: token id 1000000 outside"):
        open_store(bad_token, tok_dir, tmp_path / "cache", workers=1, progress=False)


def test_every_chat_template_the_tokenizer_loads_is_in_the_store_key(tmp_path, tok_dir):
    """transformers loads additional_chat_templates/*.jinja too (tool_use.jinja renders rows with tools): editing
    one changes the tokens, so it changes the key."""
    own = tmp_path / "tok"
    shutil.copytree(tok_dir, own)
    (own / "additional_chat_templates").mkdir()
    (own / "additional_chat_templates" / "tool_use.jinja").write_text("TOOLS A {{ messages }}")
    before = token_store.tokenizer_digest(own)
    (own / "additional_chat_templates" / "tool_use.jinja").write_text("TOOLS B {{ messages }}")
    assert token_store.tokenizer_digest(own) != before
