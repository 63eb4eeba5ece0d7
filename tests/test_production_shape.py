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


OVERRIDES = ["data=mission", "data.rows=32", "data.heldout_rows=3", "target=tiny-qwen3-next", "drafter=dflash",
             "drafter.num_layers=1", "feature_server=vllm", "trainer.token_budget=32768", "trainer.max_steps=2",
             "trainer.eval_every=0", "trainer.progress=false"]


def _planned_and_arrival_order_packs(cache_dir, target_dir, spec):
    """The run's training rows (its own cached workload and token store) packed as the run plans them (by the
    positions `spec` ships), as whole rows would be planned, and as arrival-order packing of whole rows (the next row
    into the current pack while it fits) would have: (planned tokens per pack, whole plan, arrival tokens, rows)."""
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
    arrival, used = [], 0
    for n in rows.num_tokens.tolist():
        if used + n > 32768:
            arrival.append(used)
            used = 0
        used += n
    return planned, plan_packs(rows.num_tokens, 32768), arrival + [used], rows


def test_mission_shaped_rows_train_in_full_32k_packs_with_none_skipped(tmp_path, cache_dir, tiny_target):
    target_dir = tiny_target("tiny-qwen3-next")  # built once per session, before the CLI looks for it
    run_dir = tmp_path / "run"
    run_train([*OVERRIDES, f"hydra.run.dir={run_dir}"], cache_dir)
    m = json.loads(RunDir(run_dir).metrics.read_text())
    train_skips = m["skipped_rows"]["train"]
    assert train_skips["rows_seen"] == 32 and train_skips["rows_kept"] == 32 and train_skips["counts"] == {}
    assert m["rows_truncated"] == 0 and m["pack_tokens"] == 32768
    # The 2 packs trained are the first 2 the planner made from the positions these rows ship (data/packing.py).
    positions = m["positions"]
    spec = FeatureSpec(tuple(sorted(positions["context_layer_ids"] + positions["response_layer_ids"])), "bfloat16",
                       positions["context_window"], tuple(positions["response_layer_ids"]))
    assert positions["mode"] == "read" and spec.context_window == 2048 and len(spec.response_layer_ids) == 1
    planned, whole, arrival, rows = _planned_and_arrival_order_packs(cache_dir, target_dir, spec)
    assert m["packs"] == 2 and m["train_tokens"] == sum(planned[:2]), (m["train_tokens"], planned[:2])
    # Packed by what ships: >= 2x the rows of whole-row packs, and >= 2.5x fewer state bytes per response token
    assert m["rows_per_pack"] >= 2 * len(rows) / len(whole), (m["rows_per_pack"], len(whole))
    hidden = json.loads((target_dir / "config.json").read_text())["hidden_size"]
    whole_bytes = rows.num_tokens.sum() * len(spec.layer_ids) * hidden * 2 / rows.response_tokens().sum()
    assert m["feature_bytes_per_response_token"] * 2.5 <= whole_bytes, (m["feature_bytes_per_response_token"],
                                                                        whole_bytes)
    # On whole rows' lengths planning needs a pack fewer than arrival-order packing, a fill higher by more than
    # run-to-run noise.
    fill = lambda packs: rows.num_tokens.sum() / (packs * 32768)  # noqa: E731
    assert len(whole) < len(arrival) and fill(len(whole)) > fill(len(arrival)) + 0.05, (len(whole), arrival)
    assert m["pad_fraction"] == pytest.approx(1 - m["pack_fill"]) and m["compiled_shapes"] >= 1
    # The held-out report: every report row is walked (>= 1 draft step each), tau is what its counts say.
    K = m["num_speculative_tokens"]
    assert m["heldout_drafts"] >= m["heldout_split"]["report_rows"] > 0 and len(m["per_position_acceptance"]) == K
    assert m["tau_offline"] == pytest.approx(1 + sum(m["per_position_acceptance"]))
    assert (m["samples_lost"], m["samples_duplicated"]) == (0, 0)
