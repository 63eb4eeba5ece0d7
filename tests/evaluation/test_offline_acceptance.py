"""`specdistill-eval acceptance` (specdistill/evaluation/offline_acceptance.py) end to end on hand-made runs: two
random DFlash drafters (K 3 and 2) on the tiny llama, held-out rows with stages; JSON per drafter and per stage,
the plot, seeded T > 0; the same two drafters as one `drafters=[...]` run: each evaluated, or the one named."""

import json

import pytest
import torch

from specdistill.launch.evaluate import main
from specdistill.core.run_dir import RunDir
from specdistill.core.target import TargetInfo
from specdistill.drafters.dflash import DFlashConfig, DFlashDrafter

pytestmark = pytest.mark.slow  # builds the tiny llama (shared with the session)

STAGES = ["search_queries", "filter_selection", "search_queries", "answer_writing"]
RESPONSE = [12, 9, 7, 10]


def random_dflash(target_dir, block_size: int, seed: int):
    """(config fields, state dict) of a random DFlash drafter."""
    from transformers import AutoTokenizer

    torch.manual_seed(seed)
    fields = dict(name="dflash", num_layers=1, block_size=block_size, sliding_window=None, mask_token="<|mask|>")
    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    return fields, DFlashDrafter.build(DFlashConfig(**fields), TargetInfo.load(target_dir), tokenizer).state_dict()


def fake_run(run_dir, target_dir, block_size: int, seed: int):
    """A run dir as the trainer leaves it: run_info.json config, one checkpoint, metrics.json's target."""
    fields, weights = random_dflash(target_dir, block_size, seed)
    run = RunDir(run_dir)
    run.checkpoints.mkdir(parents=True)
    meta = {"drafters": {"dflash": {"drafter": "dflash", "config": fields}}}  # as specdistill/trainer/checkpoint.py
    torch.save({"drafters": {"dflash": {"drafter": weights}}, "meta": meta}, run.checkpoint(1))
    run.run_info.write_text(json.dumps({"config": {"drafter": fields}}))
    run.metrics.write_text(json.dumps({"target": str(target_dir)}))
    return run_dir


def fake_shared_run(run_dir, target_dir):
    """The two drafters of fake_run's k3 and k2 runs as one drafters=[dflash,{...block_size:3}] run."""
    run = RunDir(run_dir)
    run.checkpoints.mkdir(parents=True)
    saved, meta = {}, {"drafters": {}}
    for name, block_size, seed in (("dflash", 4, 0), ("dflash_2", 3, 1)):
        fields, weights = random_dflash(target_dir, block_size, seed)
        saved[name], meta["drafters"][name] = {"drafter": weights}, {"drafter": "dflash", "config": fields}
    torch.save({"drafters": saved, "meta": meta}, run.checkpoint(1))
    run.metrics.write_text(json.dumps({"target": str(target_dir),
                                       "drafters": {n: {"name": n} for n in ("dflash", "dflash_2")}}))
    return run_dir


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_target):
    target = tiny_target("tiny-llama")
    root = tmp_path_factory.mktemp("acceptance")
    runs = [fake_run(root / "k3", target, 4, 0), fake_run(root / "k2", target, 3, 1),
            fake_shared_run(root / "shared", target)]
    g = torch.Generator().manual_seed(0)
    lines = []
    for i, (stage, n) in enumerate(zip(STAGES, RESPONSE)):
        ids = torch.randint(0, 200, (20 + n,), generator=g).tolist()
        lines.append(json.dumps({"id": f"h{i}", "stage": stage, "input_ids": ids, "loss_mask": [0] * 20 + [1] * n}))
    rows = root / "heldout.jsonl"
    rows.write_text("\n".join(lines[:2]) + "\n\n" + "\n".join(lines[2:]) + "\n")  # a blank line counts as a row
    return runs, rows, root


def run_cli(setup, out, *extra, runs=None):
    all_runs, rows, _ = setup
    args = ["acceptance", *(a for r in runs or all_runs[:2] for a in ("--run", str(r))), "--rows", str(rows),
            "--out", str(out), *extra]
    assert main(args) == 0
    return json.loads((out / "acceptance.json").read_text())


def test_json_per_drafter_and_stage_and_one_plot(setup, tmp_path, capsys):
    result = run_cli(setup, tmp_path)
    assert list(result["runs"]) == ["dflash:k3", "dflash:k2"]
    for label, K in (("dflash:k3", 3), ("dflash:k2", 2)):
        report = result["runs"][label]
        assert report["K"] == K and len(report["per_position"]) == K and len(report["conditional"]) == K
        assert set(report["by_stage"]) == set(STAGES)
        # Every step consumes accepted + 1 response tokens after the prefill token, per stage; a row's last step
        # may accept drafts up to its very end, and then its +1 (the bonus token) lies past the response.
        for stage in set(STAGES):
            s = report["by_stage"][stage]
            rows = [n for st, n in zip(STAGES, RESPONSE) if st == stage]
            consumed = s["num_drafts"] + s["num_accepted"]
            assert sum(n - 1 for n in rows) <= consumed <= sum(rows), (stage, s)
        assert report["num_drafts"] == sum(s["num_drafts"] for s in report["by_stage"].values())
        assert report["tau"] == pytest.approx(1 + sum(report["per_position"]))
    png = (tmp_path / "acceptance.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    last = capsys.readouterr().out.strip().splitlines()[-2:]
    assert [line.split(":")[0] for line in last] == ["tau[dflash", "tau[dflash"]


def test_positive_temperature_is_seeded(setup, tmp_path):
    args = ("--temperature", "1.5", "--draft-mode", "sample", "--seed", "7")
    one = run_cli(setup, tmp_path / "a", *args, runs=setup[0][:1])
    two = run_cli(setup, tmp_path / "b", *args, runs=setup[0][:1])
    assert one["runs"] == two["runs"] and one["runs"]["dflash:k3"]["draft_mode"] == "sample"


def test_every_drafter_of_a_shared_run_or_the_one_named(setup, tmp_path):
    alone = run_cli(setup, tmp_path / "alone")["runs"]
    shared = run_cli(setup, tmp_path / "all", runs=setup[0][2:])["runs"]
    assert list(shared) == ["dflash:shared", "dflash_2:shared"]
    # The same weights give the same report, whether trained alone or beside another drafter.
    assert shared["dflash:shared"] == alone["dflash:k3"] and shared["dflash_2:shared"] == alone["dflash:k2"]
    named = run_cli(setup, tmp_path / "one", "--drafter", "dflash_2", runs=setup[0][2:])["runs"]
    assert list(named) == ["dflash_2:shared"] and named["dflash_2:shared"] == alone["dflash:k2"]
    with pytest.raises(ValueError, match=r"trained \['dflash', 'dflash_2'\]: none of --drafter eagle3"):
        run_cli(setup, tmp_path / "none", "--drafter", "eagle3", runs=setup[0][2:])
