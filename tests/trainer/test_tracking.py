"""specdistill/trainer/tracking.py: the logger group composes strictly; wandb writes an offline run holding config, per-step
metrics, per-position acceptance and the export path, even when the environment says WANDB_MODE=online."""

import json
import struct
import zlib
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from specdistill.core.run_dir import RunDir
from specdistill.launch.config import compose_config
from specdistill.trainer.tracking import LoggerConfig, Tracker, flatten_lists

RECORDS = [{"step": 1, "loss": 2.0, "accuracy_per_position": [0.5, 0.25], "tau_estimate": 1.7},
           {"step": 2, "loss": 1.5, "accuracy_per_position": [0.625, 0.375], "tau_estimate": 1.9}]
FINAL = {"tau_offline": 2.5, "per_position_acceptance": [0.875, 0.5], "export_dir": "/runs/x/export",
         "final_loss": 1.5, "conditional_acceptance": None, "skipped_rows": {"train": {}}}



def test_logger_group_defaults_to_none_and_wandb_to_offline():
    assert OmegaConf.to_object(compose_config([]).logger) == LoggerConfig(backend="none")
    cfg = compose_config(["logger=wandb", "logger.project=p"])
    assert (cfg.logger.backend, cfg.logger.mode, cfg.logger.project) == ("wandb", "offline", "p")


@pytest.mark.parametrize("override", ["logger.mdoe=online", "logger=tensorboard"])
def test_logger_typos_fail_at_compose(override):
    with pytest.raises(Exception, match="mdoe|tensorboard"):
        compose_config([override])


def test_bad_mode_names_the_valid_ones(tmp_path):
    with pytest.raises(ValueError, match="logger.mode='onlnie'; valid: offline, online"):
        Tracker(LoggerConfig(backend="wandb", mode="onlnie"), tmp_path, {}, enabled=True)


def test_flatten_lists_numbers_positions_from_one():
    assert flatten_lists({"a": [3, None, 5], "b": None, "c": "x"}) == {"a/1": 3, "a/3": 5, "c": "x"}


def test_none_logger_writes_only_the_jsonl(tmp_path):
    tracker = Tracker(LoggerConfig(), tmp_path, {}, enabled=True)
    for r in RECORDS:
        tracker.log(r)
    tracker.finish(FINAL)
    assert [json.loads(line) for line in RunDir(tmp_path).train_log.read_text().splitlines()] == RECORDS
    assert not (tmp_path / "wandb").exists()


def test_non_main_rank_writes_nothing(tmp_path):
    tracker = Tracker(LoggerConfig(backend="wandb"), tmp_path, {}, enabled=False)
    tracker.log(RECORDS[0])
    tracker.finish(FINAL)
    assert list(tmp_path.iterdir()) == []


def test_wandb_offline_run_holds_config_steps_acceptance_and_export(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "online")  # logger.mode (offline by default) must win over the env
    monkeypatch.setenv("WANDB_API_KEY", "")
    config = {"trainer": {"lr": 0.003, "max_steps": 2}, "drafter": {"name": "dflash"}}
    tracker = Tracker(LoggerConfig(backend="wandb"), tmp_path, config, enabled=True)
    for r in RECORDS:
        tracker.log(r)
    assert _inet_listeners_of_children() == []  # wandb's own processes talk over unix sockets only
    tracker.finish(FINAL)

    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    records = read_wandb_records(next(run_dir.glob("run-*.wandb")))
    configs = [r.run.config for r in records if r.HasField("run")] + [r.config for r in records if r.HasField("config")]
    logged_config = {i.key: json.loads(i.value_json) for c in configs for i in c.update}
    assert logged_config["trainer"] == config["trainer"] and logged_config["drafter"] == config["drafter"]
    history = [{_key(i): json.loads(i.value_json) for i in r.history.item} for r in records if r.HasField("history")]
    assert [(h["_step"], h["loss"], h["accuracy_per_position/2"]) for h in history] == [(1, 2.0, 0.25), (2, 1.5, 0.375)]
    summary = {_key(i): json.loads(i.value_json) for r in records if r.HasField("summary") for i in r.summary.update}
    assert summary["export_dir"] == "/runs/x/export" and summary["tau_offline"] == 2.5
    assert (summary["per_position_acceptance/1"], summary["per_position_acceptance/2"]) == (0.875, 0.5)


def _inet_listeners_of_children() -> list:
    import psutil

    pids = {p.pid for p in psutil.Process().children(recursive=True)}
    return [c.laddr for c in psutil.net_connections("inet") if c.status == psutil.CONN_LISTEN and c.pid in pids]


def _key(item) -> str:
    return item.key or "/".join(item.nested_key)


def read_wandb_records(path: Path) -> list:
    """The .wandb datastore: a 7-byte header then LevelDB-log framed wandb Record protobufs (32 KiB blocks,
    records split FIRST/MIDDLE/LAST across blocks, crc32 seeded with the type byte). wandb >= 0.2x ships no
    Python reader (its Go core writes the file), so this re-reads the format with wandb's own protobuf schema."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B" and struct.unpack("<H", data[4:6])[0] == 0xBEE1, f"{path}: not a wandb datastore"
    records, pending, pos, block = [], b"", 7, 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block tail too short for a header is zero padding
            pos += block - pos % block
            continue
        checksum, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            continue
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF == checksum, f"{path}: bad crc at {pos}"
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):  # FULL or LAST: a whole record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records
