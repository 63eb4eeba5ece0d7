"""Self-distilled train / held-out sets from real text (specdistill/data/corpus_workload.py):

    specdistill-corpus-workload --target DIR --out DIR --rows 10000 --heldout 100 [--max-new-tokens 64] \
        [--format jsonl|parquet]
"""

import argparse

from specdistill.data.corpus_workload import CorpusWorkload, make_corpus_workload
from specdistill.launch.command import common_flags, start


def main(argv: list[str] | None = None) -> None:
    p = common_flags(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
    p.add_argument("--target", required=True, help="target checkpoint directory")
    p.add_argument("--out", required=True)
    d = CorpusWorkload()
    p.add_argument("--rows", type=int, default=d.rows)
    p.add_argument("--heldout", type=int, default=d.heldout_rows)
    p.add_argument("--prompt-min-tokens", type=int, default=d.prompt_min_tokens)
    p.add_argument("--prompt-max-tokens", type=int, default=d.prompt_max_tokens)
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--backend", default=d.backend, choices=("auto", "vllm", "hf"))
    p.add_argument("--format", default="jsonl", choices=("jsonl", "parquet"),
                   help="parquet: ids only, compact enough to commit (the demo's rows)")
    a = start(p.parse_args(argv))
    cfg = CorpusWorkload(a.rows, a.heldout, a.prompt_min_tokens, a.prompt_max_tokens, a.max_new_tokens, a.seed,
                         a.batch_size, a.backend)
    train, held = make_corpus_workload(a.target, a.out, cfg, out_format=a.format)
    print(f"wrote {train} and {held}")


if __name__ == "__main__":
    main()
