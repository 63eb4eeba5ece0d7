"""A drafter's held-out curve on cached features (an experiment tool, not a test): the training step and the held-out
walk of `specdistill-train`, with the target's states extracted once and kept on disk, so variants of a drafter
(optimizer settings, initialisation, anchors) are compared step for step without re-running the target.

    python bench/cached_curve.py dflash --steps 300 --set num_layers=2 [--tset muon_lr=0.005] [--rows 6000]
                                 [--eval-every 50] [--ablation zero] [--threads 2]

Data: `target=small-real data=corpus` (8,000 training rows, 128 held-out), the first --rows training rows and
--heldout held-out rows, in dataset order, epoch after epoch. Features: every layer 1..L of the target in bf16 (any
drafter's ids are a subset), extracted once with the HF backend into CACHE/cached_features/. Steps and the held-out
walk are the trainer's own (specdistill/trainer/trainer.py `_step` semantics: grad clip, Muon + AdamW, the LR schedule of
trainer.max_steps = --steps; specdistill/evaluation/served.py: the export's dtype, greedy, K as served).
--set KEY=VALUE sets a drafter field, --tset a trainer field (JSON values). Last lines:
  step N: heldout_tau X a_1 Y            at every evaluation
  final_heldout_tau: X
  best_heldout_tau: X
"""

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from specdistill.core.batch import pack_stream  # noqa: E402
from specdistill.core.contract import FeatureSample, FeatureSpec  # noqa: E402
from specdistill.core.target import TargetHead, TargetInfo  # noqa: E402
from specdistill.drafters import build_drafter, drafter_config  # noqa: E402
from specdistill.evaluation.served import evaluate_as_served  # noqa: E402
from specdistill.data.formats import load_rows  # noqa: E402
from specdistill.feature_server.hf_backend import HFBackend  # noqa: E402
from specdistill.launch.config import DataConfig, TargetConfig  # noqa: E402
from specdistill.launch.prepare import resolve_data, resolve_target  # noqa: E402
from specdistill.trainer.ablation import ablate  # noqa: E402
from specdistill.trainer.config import TrainerConfig  # noqa: E402
from specdistill.trainer.metrics import StepMetrics  # noqa: E402
from specdistill.trainer.optim import Optimizers  # noqa: E402

CORPUS = DataConfig(source="corpus", rows=8000, heldout_rows=128, prompt_tokens=320, prompt_min_tokens=96,
                    max_new_tokens=64)


def cached_features(target_dir: Path, rows, cache_file: Path, layer_ids: tuple[int, ...]) -> list[FeatureSample]:
    """Every row's states at layer_ids (bf16), extracted once into cache_file (plain tensors: weights_only loads)."""
    if cache_file.is_file():
        d = torch.load(cache_file, weights_only=True)
        return [FeatureSample(int(i), ids, mask.bool(), h)
                for i, ids, mask, h in zip(d["row_ids"].tolist(), d["input_ids"], d["loss_mask"], d["hidden"])]
    backend = HFBackend(str(target_dir), FeatureSpec(layer_ids), "cpu")
    samples = [FeatureSample(r.row_id, torch.tensor(r.input_ids), torch.tensor(r.loss_mask).bool(),
                             backend.extract([r])[0].to(torch.bfloat16)) for r in rows]
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"row_ids": torch.tensor([s.row_id for s in samples]), "input_ids": [s.input_ids_T for s in samples],
                "loss_mask": [s.loss_mask_T for s in samples], "hidden": [s.hidden_TLD for s in samples]},
               cache_file.with_suffix(".tmp"))
    cache_file.with_suffix(".tmp").rename(cache_file)
    return samples


def json_settings(pairs: list[str]) -> dict:
    out = {}
    for pair in pairs:
        key, value = pair.split("=", 1)
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value  # a bare string
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("drafter")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--rows", type=int, default=6000)
    ap.add_argument("--heldout", type=int, default=64)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a drafter field")
    ap.add_argument("--tset", action="append", default=[], metavar="KEY=VALUE", help="a trainer field")
    ap.add_argument("--ablation", default="none", help="trainer.feature_ablation: none | zero | shuffle")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cache-dir", default=".cache/specdistill")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    cache = Path(a.cache_dir)
    target_dir = resolve_target(TargetConfig(name="small-real"), cache)
    train_path, heldout_path = resolve_data(CORPUS, target_dir, cache)
    target = TargetInfo.load(target_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(target_dir), local_files_only=True)
    layer_ids = tuple(range(1, target.num_hidden_layers + 1))
    rows = load_rows(train_path, tokenizer, 4096)[0][: a.rows]
    held = load_rows(heldout_path, tokenizer, 4096)[0][: a.heldout]
    where = cache / "cached_features" / train_path.parent.name
    train = cached_features(target_dir, rows, where / f"train-{a.rows}.pt", layer_ids)
    heldout = cached_features(target_dir, held, where / f"heldout-{a.heldout}.pt", layer_ids)

    torch.manual_seed(0)
    drafter = build_drafter(drafter_config(a.drafter, json_settings(a.set)), target, tokenizer)
    drafter.prepare(rows)
    head = TargetHead(target)
    cfg = TrainerConfig(**{"max_steps": a.steps, **json_settings(a.tset)})
    optimizers = Optimizers(drafter, cfg)
    generator = torch.Generator().manual_seed(cfg.seed)
    inputs = drafter.input_layer_ids()

    def walk(step: int, window: StepMetrics, seconds: float) -> float:
        report = evaluate_as_served(drafter, head, heldout, layer_ids, torch.device("cpu")).total
        train_acc = " ".join(f"{x:.2f}" for x in window.summary()["accuracy_per_position"])
        print(f"step {step}: heldout_tau {report.tau:.3f} a_1 {report.per_position[0]:.3f} "
              f"(train acc {train_acc}; {seconds:.0f} s of steps)", flush=True)
        return report.tau

    curve, step, seconds = [walk(0, StepMetrics(drafter.num_speculative_tokens), 0.0)], 0, 0.0
    window = StepMetrics(drafter.num_speculative_tokens)
    while step < a.steps:
        for batch in pack_stream(train, cfg.token_budget, layer_ids):
            started = time.perf_counter()
            batch = ablate(batch.to(torch.device("cpu"), torch.float32), a.ablation, inputs, generator)
            optimizers.set_step(step)
            out = drafter(batch, head, generator)
            out.loss.backward()
            if not optimizers.clip_step_and_zero(drafter.parameters(), cfg.grad_clip):
                raise FloatingPointError(f"step {step + 1}: non-finite gradients (loss {float(out.loss):.4g}); "
                                         "the curve stops here rather than count a step not taken")
            seconds += time.perf_counter() - started
            window.add(out)
            step += 1
            if step % a.eval_every == 0 or step == a.steps:
                curve.append(walk(step, window, seconds))
                window = StepMetrics(drafter.num_speculative_tokens)
            if step == a.steps:
                break
    print(f"final_heldout_tau: {curve[-1]:.3f}")
    print(f"best_heldout_tau: {max(curve):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
