"""The mission's shape on CPU: ~5k-token chat prompts and ~45-token JSON responses (conf/data/mission.yaml) in
32,768-token packs, extracted by real vLLM workers from a tiny hybrid target, trained through the CLI."""

import json

import pytest

from specdistill.core.run_dir import RunDir
from tests.cli import run_train

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


OVERRIDES = ["data=mission", "data.rows=60", "data.heldout_rows=6", "target=tiny-qwen3-next", "drafter=dflash",
             "drafter.num_layers=1", "feature_server=vllm", "trainer.token_budget=32768", "trainer.max_steps=6",
             "trainer.eval_every=0", "trainer.progress=false"]


def _planned_and_arrival_order_packs(cache_dir, target_dir):
    """The run's training rows (its own cached workload and token store) packed as the run plans them, and as
    arrival-order packing (the next row into the current pack while it fits) would have."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from specdistill.data.packing import plan_packs
    from specdistill.data.selection import load_selected
    from specdistill.launch.config import register_configs
    from specdistill.launch.prepare import resolve_data
    from tests.cli import REPO

    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        data_cfg = OmegaConf.to_object(compose(config_name="config", overrides=OVERRIDES).data)
    train_path, _ = resolve_data(data_cfg, target_dir, cache_dir)
    rows, _, _ = load_selected(train_path, target_dir, cache_dir, 32768, data_cfg, progress=False)
    lengths = rows.num_tokens
    planned = [int(lengths[p].sum()) for p in plan_packs(lengths, 32768)]
    arrival, used = [], 0
    for n in lengths.tolist():
        if used + n > 32768:
            arrival.append(used)
            used = 0
        used += n
    return planned, arrival + [used]


def test_mission_shaped_rows_train_in_full_32k_packs_with_none_skipped(tmp_path, cache_dir, tiny_target):
    target_dir = tiny_target("tiny-qwen3-next")  # built once per session, before the CLI looks for it
    run_dir = tmp_path / "run"
    run_train([*OVERRIDES, f"hydra.run.dir={run_dir}"], cache_dir)
    m = json.loads(RunDir(run_dir).metrics.read_text())
    train_skips = m["skipped_rows"]["train"]
    assert train_skips["rows_seen"] == 60 and train_skips["rows_kept"] == 60 and train_skips["counts"] == {}
    assert m["rows_truncated"] == 0 and m["pack_tokens"] == 32768
    # The 6 packs trained are the first 6 the planner made from these rows' lengths (data/packing.py), and on these
    # lengths planning needs a pack fewer than arrival-order packing, a fill higher by more than run-to-run noise.
    planned, arrival = _planned_and_arrival_order_packs(cache_dir, target_dir)
    assert m["packs"] == 6 and m["train_tokens"] == sum(planned[:6]), (m["train_tokens"], planned[:6])
    fill = lambda packs: sum(packs) / (len(packs) * 32768)  # noqa: E731
    assert len(planned) < len(arrival) and fill(planned) > fill(arrival) + 0.05, (planned, arrival)
    assert m["pad_fraction"] == pytest.approx(1 - m["pack_fill"]) and m["compiled_shapes"] >= 1
    # The held-out report: every report row is walked (>= 1 draft step each), tau is what its counts say.
    K = m["num_speculative_tokens"]
    assert m["heldout_drafts"] >= m["heldout_split"]["report_rows"] > 0 and len(m["per_position_acceptance"]) == K
    assert m["tau_offline"] == pytest.approx(1 + sum(m["per_position_acceptance"]))
    assert (m["samples_lost"], m["samples_duplicated"]) == (0, 0)
