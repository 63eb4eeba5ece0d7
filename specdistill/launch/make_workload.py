"""Synthetic workload rows answered by a target (specdistill/data/synthetic.py):

    specdistill-make-workload --target DIR --out DIR --rows N --heldout M \
        [--max-new-tokens 48] [--prompt-tokens 400] [--prompt-spread 0] [--backend auto] [--seed 0]
"""

import argparse

from specdistill.data.synthetic import make_workload
from specdistill.data.workload import DEFAULT_PROMPT_TOKENS
from specdistill.launch.command import common_flags, start


def main(argv: list[str] | None = None) -> None:
    p = common_flags(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
    p.add_argument("--target", required=True, help="target checkpoint directory")
    p.add_argument("--out", required=True, help="output directory for train.jsonl / heldout.jsonl")
    p.add_argument("--rows", type=int, required=True)
    p.add_argument("--heldout", type=int, required=True)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--prompt-tokens", type=int, default=DEFAULT_PROMPT_TOKENS, help="median prompt length")
    p.add_argument("--prompt-spread", type=float, default=0.0,
                   help="sigma of the log prompt length (0: every prompt ~prompt-tokens; 0.3 spreads like real ones)")
    p.add_argument("--backend", default="auto", choices=("auto", "vllm", "hf"))
    p.add_argument("--seed", type=int, default=0)
    a = start(p.parse_args(argv))
    train, held = make_workload(a.target, a.out, a.rows, a.heldout, a.max_new_tokens, a.prompt_tokens, a.seed,
                                a.backend, a.prompt_spread)
    print(f"wrote {train} and {held}")


if __name__ == "__main__":
    main()
