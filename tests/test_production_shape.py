"""The mission's shape on CPU: ~5k-token chat prompts and ~45-token JSON responses (specdistill/conf/data/mission.yaml) in
32,768-token packs, extracted by real vLLM workers from a tiny hybrid target, trained through the CLI. DFlash reads its
context 2,048 tokens back from a row's first response token: the workers ship only that (feature_server.positions=
read), and the planner packs by it, ~15 rows a pack instead of ~6."""

import json

import pytest

from specdistill.core.contract import FeatureSpec
from specdistill.core.run_dir import RunDir
from tests.cli import run_train

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


OVERRIDES = ["data=mission", "data.rows=15", "data.heldout_rows=2", "target=tiny-qwen3-next", "drafter=dflash",
             "drafter.num_layers=1", "feature_server=vllm", "trainer.token_budget=32768", "trainer.max_steps=1",
             "trainer.eval_every=0", "trainer.progress=false"]


def _planned_packs(cache_dir, target_dir, spec):
    """The run's training rows (its own cached workload and token store) packed as the run plans them (by the
    positions `spec` ships) and as whole rows would be planned: (planned tokens per pack, whole plan, rows). Planning
    against arrival order at this shape: tests/data/test_packing.py."""
    from omegaconf import OmegaConf

    from specdistill.core.batch import shipped_tokens
    from specdistill.data.packing import plan_packs
    from specdistill.data.selection import load_selected
    from specdistill.launch.config import compose_config
    from specdistill.launch.prepare import resolve_data

    data_cfg = OmegaConf.to_object(compose_config(OVERRIDES).data)
    train_path, _ = resolve_data(data_cfg, target_dir, cache_dir)
    rows, _, _ = load_selected(train_path, target_dir, cache_dir, 32768, data_cfg, progress=False,
                               window=spec.context_window)
    shipped = shipped_tokens(rows, spec)
    planned = [int(shipped[p].sum()) for p in plan_packs(shipped, 32768)]
    return planned, plan_packs(rows.num_tokens, 32768), rows


def test_mission_shaped_rows_train_in_full_32k_packs_with_none_skipped(tmp_path, cache_dir, tiny_target):
    target_dir = tiny_target("tiny-qwen3-next")  # built once per session, before the CLI looks for it
    run_dir = tmp_path / "run"
    run_train([*OVERRIDES, f"hydra.run.dir={run_dir}"], cache_dir)
    m = json.loads(RunDir(run_dir).metrics.read_text())
    train_skips = m["skipped_rows"]["train"]
    assert train_skips["rows_seen"] == 15 and train_skips["rows_kept"] == 15 and train_skips["counts"] == {}
    assert m["rows_truncated"] == 0 and m["pack_tokens"] == 32768
    # The one pack trained is the first made from the positions these rows ship (data/packing.py).
    positions = m["positions"]
    spec = FeatureSpec(tuple(sorted(positions["context_layer_ids"] + positions["response_layer_ids"])), "bfloat16",
                       positions["context_window"], tuple(positions["response_layer_ids"]))
    assert positions["mode"] == "read" and spec.context_window == 2048 and len(spec.response_layer_ids) == 1
    planned, whole, rows = _planned_packs(cache_dir, target_dir, spec)
    assert m["packs"] == 1 and m["train_tokens"] == planned[0] and len(planned) == 1, (m["train_tokens"], planned)
    # Packed by what ships: >= 2x the rows of whole-row packs, and >= 2.5x fewer state bytes per response token
    assert m["rows_per_pack"] >= 2 * len(rows) / len(whole), (m["rows_per_pack"], len(whole))
    hidden = json.loads((target_dir / "config.json").read_text())["hidden_size"]
    whole_bytes = rows.num_tokens.sum() * len(spec.layer_ids) * hidden * 2 / rows.response_tokens().sum()
    assert m["feature_bytes_per_response_token"] * 2.5 <= whole_bytes, (m["feature_bytes_per_response_token"],
                                                                        whole_bytes)
    assert m["pad_fraction"] == pytest.approx(1 - m["pack_fill"]) and m["compiled_shapes"] >= 1
    # The held-out report: every report row is walked (>= 1 draft step each), tau is what its counts say.
    K = m["num_speculative_tokens"]
    assert m["heldout_drafts"] >= m["heldout_split"]["report_rows"] > 0 and len(m["per_position_acceptance"]) == K
    assert m["tau_offline"] == pytest.approx(1 + sum(m["per_position_acceptance"]))
    assert (m["samples_lost"], m["samples_duplicated"]) == (0, 0)
