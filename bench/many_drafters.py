"""One prefill, many drafters (not a test): `python bench/many_drafters.py [--steps 12] [--drafters dflash,dflash2,eagle3]
[--out outputs/many_drafters]`.

Trains the drafters on `small-real` with the committed corpus rows (bench/demo.py's data; MTP needs a target with an
MTP layer) twice, same seed, rows, steps and threads: once in one run (`drafters=[...]`: one feature server, one
prefill of every row, the drafters stepping in turn on each pack), and once each in a run of its own. Prints, last:
  wall_ratio              shared run's wall time / the solo runs' summed (whole processes: start, extraction,
                          training, validation, export)
  extraction_s_shared / extraction_s_solos_summed   worker-side prefill seconds (metrics.json
                          feature_extraction_seconds), the shared run's against the solos' total
  target_tokens_shared / target_tokens_solos_summed  tokens the workers prefilled
  {name}_training_s_shared / _solo   the drafter's own training seconds
  {name}_tau_shared / _solo          its held-out tau (equal: the same weights, tests/test_many_drafters.py)
  tau_equal               1 when every drafter's tau is the same in both
The drafters' default configs are production-sized (5-layer DFlash, ...), so a step takes seconds on 2 CPU cores;
the default 12 steps keep the whole bench near 20 minutes. Held-out tau after 12 steps is far from trained: the
comparison is of cost, with equality as the check that sharing changes nothing.
"""

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.demo import HELDOUT, TRAIN  # noqa: E402

COMMON = ["target=small-real", "data=jsonl", f"data.train_path={TRAIN}", f"data.heldout_path={HELDOUT}",
          "trainer.eval_every=0", "trainer.eval_rows=32", "trainer.probe_rows=0", "trainer.progress=false",
          "trainer.seed=0"]


def run(overrides: list[str], run_dir: Path) -> tuple[dict, float]:
    """One `specdistill-train` run from scratch: (metrics.json, wall seconds of the whole process)."""
    if run_dir.exists():
        shutil.rmtree(run_dir)
    cmd = [sys.executable, "-m", "specdistill.launch.train", *COMMON, *overrides, f"hydra.run.dir={run_dir}"]
    print("+", " ".join(cmd[1:]), flush=True)
    started = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    return json.loads((run_dir / "metrics.json").read_text()), time.perf_counter() - started


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--drafters", default="dflash,dflash2,eagle3")
    ap.add_argument("--out", type=Path, default=REPO / "outputs/many_drafters")
    a = ap.parse_args()
    names = a.drafters.split(",")
    steps = [f"trainer.max_steps={a.steps}"]
    shared, shared_wall = run([f"drafters=[{','.join(names)}]", *steps], a.out / "shared")
    solos = {name: run([f"drafter={name}", *steps], a.out / name) for name in names}
    solo_wall = sum(wall for _, wall in solos.values())
    figures = {"wall_s_shared": shared_wall, "wall_s_solos_summed": solo_wall, "wall_ratio": shared_wall / solo_wall,
               "extraction_s_shared": shared["feature_extraction_seconds"],
               "extraction_s_solos_summed": sum(m["feature_extraction_seconds"] for m, _ in solos.values()),
               "target_tokens_shared": shared["target_tokens_prefilled"],
               "target_tokens_solos_summed": sum(m["target_tokens_prefilled"] for m, _ in solos.values())}
    equal = True
    for name in names:
        mine, alone = shared["drafters"][name], solos[name][0]
        figures[f"{name}_training_s_shared"] = mine["training_seconds"]
        figures[f"{name}_training_s_solo"] = alone["training_seconds"]
        figures[f"{name}_tau_shared"], figures[f"{name}_tau_solo"] = mine["tau_offline"], alone["tau_offline"]
        equal &= mine["tau_offline"] == alone["tau_offline"]
    figures["tau_equal"] = int(equal)
    for key, value in figures.items():
        print(f"{key}: {value:.4g}" if isinstance(value, float) else f"{key}: {value}")
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
