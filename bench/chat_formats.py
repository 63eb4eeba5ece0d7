"""Multi-turn chat files in five template families, trained end to end (not a test):
`python bench/chat_formats.py [--conversations 240] [--steps 12] [--families qwen3,llama3,gemma,llama2,gpt-oss]`.

For each family of tests/data/chat_families.py (Qwen3 with enable_thinking=false, Llama 3.1, Gemma 2, Llama 2
[INST], gpt-oss harmony): a tokenizer built locally in the family's published format, a random tiny Llama target
using it, and a ShareGPT-style file of multi-turn shop conversations (2-4 assistant turns, a system message where
the template has a system role); then `specdistill-train drafter=eagle3 target.path=DIR data=jsonl ...` trains on it
end to end (token store, selection, feature server, trainer, held-out walk). Prints per family: conversations,
turns trained (token-store rows, data.loss_on=all), tokens and response tokens in the store, turns whose response was
retokenized, the run's steps, trained tokens and skipped rows, and the prefix-sharing measurement:

  per-turn rows   what the store holds: one sequence per trained turn, its whole history re-prefilled each time
  shared          one sequence per conversation where every turn's rendering (through its stop token) is a token
                  prefix of the next turn's prompt (templates that do not rewrite history), else per-turn rows;
                  "tokens prefilled" is what the target would prefill either way.

Shared sequences are measured, not built: a row then has several response spans, which the held-out walk
(one span per row) and left truncation (the first span) do not handle; docs/data.md "Whole conversations".
"""

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The repository, not bench/, first on the path: bench/kernels.py would shadow the `kernels` package transformers loads.
sys.path = [str(REPO)] + [p for p in sys.path if Path(p or ".").resolve() != REPO / "bench"]

FAMILIES = ("qwen3", "llama3", "gemma", "llama2", "gpt-oss")
KWARGS = {"qwen3": {"enable_thinking": False}, "gpt-oss": {"model_identity": "Shop bot."}}
ITEMS = ("trail shoes", "tent", "rain jacket", "backpack", "head lamp", "camp chair", "sleeping bag", "stove")
COLOURS = ("red", "blue", "black", "green", "grey")


def conversation(rng: random.Random, system: bool) -> dict:
    """A ShareGPT row: a shopper refining a search over 2-4 turns, the assistant answering in JSON."""
    item, query = rng.choice(ITEMS), {}
    turns = [{"from": "system", "value": "Return JSON for the shop's search API."}] if system else []
    for _ in range(rng.randint(2, 4)):
        change = rng.choice(("colour", "price", "size", "item"))
        if change == "colour":
            query["colour"] = rng.choice(COLOURS)
            ask = f"in {query['colour']} please"
        elif change == "price":
            query["max_price"] = rng.randrange(20, 300, 10)
            ask = f"under ${query['max_price']}"
        elif change == "size":
            query["size"] = rng.randint(36, 47)
            ask = f"size {query['size']}"
        else:
            item = rng.choice(ITEMS)
            ask = f"show me a {item} instead"
        query["query"] = item
        turns += [{"from": "human", "value": ask}, {"from": "gpt", "value": json.dumps(dict(sorted(query.items())))}]
    return {"conversations": turns}


def make_target(family: str, root: Path, texts: list[str]) -> Path:
    """The family's tokenizer and a random 2-layer Llama over its vocabulary."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from tests.data.chat_families import build_tokenizer

    target = build_tokenizer(family, root / "target", texts, vocab_size=800)
    tok = AutoTokenizer.from_pretrained(str(target))
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=2048,
                         pad_token_id=0, bos_token_id=None, eos_token_id=None)
    generation_config = (target / "generation_config.json").read_text()
    LlamaForCausalLM(config).save_pretrained(str(target))
    (target / "generation_config.json").write_text(generation_config)  # the family's eos ids, not save_pretrained's
    return target


def prefix_sharing(path: Path, target: Path, kwargs: dict) -> dict:
    """Tokens the target prefills for the file's trained turns: one row per turn vs one sequence per conversation
    where every turn's rendering is a token prefix of the next turn's prompt."""
    from specdistill.data.chat import ChatFormat
    from specdistill.data.config import DataConfig
    from specdistill.data.formats import chunks, conversation as convo_of, parse_row, read_chunk

    chat, cfg = ChatFormat.load(target, kwargs), DataConfig(chat_template_kwargs=kwargs)
    per_turn = shared = shareable = conversations = 0
    for chunk in chunks(path):
        for _, obj, at in read_chunk(chunk):
            turns = [t for t in parse_row(chat, obj, at, cfg.loss_on) if t is not None]
            assert convo_of(obj, at) is not None
            conversations += 1
            lengths = [len(t.input_ids) for t in turns]
            per_turn += sum(lengths)
            nested = all(a.input_ids == b.input_ids[:len(a.input_ids)] for a, b in zip(turns, turns[1:]))
            shareable += nested
            shared += lengths[-1] if nested else sum(lengths)
    return {"conversations_shareable": f"{shareable}/{conversations}", "tokens_per_turn_rows": per_turn,
            "tokens_shared": shared, "shared_over_per_turn": round(shared / per_turn, 3)}


def train(family: str, root: Path, steps: int, train_path: Path, heldout_path: Path, target: Path) -> dict:
    kwargs = KWARGS.get(family)
    cmd = [sys.executable, "-m", "specdistill.launch.train", "drafter=eagle3", f"target.path={target}",
           "data=jsonl", f"data.train_path={train_path}", f"data.heldout_path={heldout_path}",
           f"trainer.max_steps={steps}", "trainer.token_budget=2048", "trainer.eval_rows=8", "trainer.probe_rows=0",
           "trainer.progress=false", f"cache_dir={root / 'cache'}", f"hydra.run.dir={root / 'run'}"]
    if kwargs:
        cmd.append("data.chat_template_kwargs={" + ", ".join(f"{k}:{json.dumps(v)}" for k, v in kwargs.items()) + "}")
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{family}: training failed:\n{done.stderr[-4000:]}")
    metrics = json.loads((root / "run" / "metrics.json").read_text())
    return {**metrics, "wall_s": round(time.perf_counter() - t0, 1)}


def store_meta(root: Path, train_path: Path) -> dict:
    metas = [json.loads(p.read_text()) for p in (root / "cache" / "tokens").glob("*/meta.json")]
    return next(m for m in metas if m["source"] == str(train_path))


def run_family(family: str, work: Path, n: int, steps: int) -> dict:
    root = work / family
    root.mkdir(parents=True)
    rng = random.Random(f"chat-formats:{family}")
    rows = [conversation(rng, system=family != "gemma") for _ in range(n + 16)]
    train_path, heldout_path = root / "train.jsonl", root / "heldout.jsonl"
    train_path.write_text("".join(json.dumps(r) + "\n" for r in rows[:n]))
    heldout_path.write_text("".join(json.dumps(r) + "\n" for r in rows[n:]))
    target = make_target(family, root, [json.dumps(r) for r in rows])
    metrics = train(family, root, steps, train_path, heldout_path, target)
    meta = store_meta(root, train_path)
    return {"conversations": meta["input_rows"], "turns_trained": meta["rows"], "tokens": meta["tokens"],
            "response_tokens": meta["response_tokens"], "retokenized": meta["report"]["retokenized"],
            "skipped": meta["report"]["counts"], "steps": metrics["steps"], "epochs": metrics["epochs_completed"],
            "train_tokens": metrics["train_tokens"], "train_response_tokens": metrics["train_response_tokens"],
            "pack_fill": round(metrics["pack_fill"], 3), "tau_offline": round(metrics["tau_offline"] or 0, 3),
            "wall_s": metrics["wall_s"], **prefix_sharing(train_path, target, KWARGS.get(family, {}))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, default=240)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--dir", help="work directory (default: a temporary one, removed after)")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        results = {f: run_family(f, Path(tmp), a.conversations, a.steps) for f in a.families.split(",")}
    for family, r in results.items():
        print(f"{family}: {json.dumps(r)}")


if __name__ == "__main__":
    main()
