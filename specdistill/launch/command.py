"""What every console script answers the same way: `--version` (the package's), `--verbose` (every library notice,
specdistill/core/quiet.py), `--help`.

argparse commands take them with `common_flags(parser)` and `start(args)`; the key=value commands
(specdistill-train, which Hydra parses and whose `--version` would print Hydra's, and specdistill-regenerate) take
them out of argv first with `own_flags(argv, usage)`.
"""

import argparse
import sys

from specdistill import __version__
from specdistill.core.quiet import quiet_libraries

VERSION = f"specdistill {__version__}"
VERBOSE_HELP = "show every vLLM, transformers and torch notice (default: results, warnings that matter, errors; " \
               "SPECDISTILL_VERBOSE=1 does the same)"


def common_flags(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--version", action="version", version=VERSION)
    parser.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    return parser


def start(args: argparse.Namespace) -> argparse.Namespace:
    """Sets up the output as the command line asked (call before the libraries load, as far as possible)."""
    quiet_libraries(getattr(args, "verbose", False))
    return args


def own_flags(argv: list[str], usage: str) -> list[str]:
    """argv without --verbose (applied); --version and --help answered here (usage: the command's help text)."""
    if "--version" in argv:
        print(VERSION)
        raise SystemExit(0)
    if {"-h", "--help"} & set(argv) and usage:
        print(usage)
        raise SystemExit(0)
    quiet_libraries("--verbose" in argv)
    return [a for a in argv if a != "--verbose"]


def own_flags_of_sys_argv(usage: str = "") -> None:
    """own_flags on sys.argv in place (what Hydra's main reads)."""
    sys.argv[1:] = own_flags(sys.argv[1:], usage)
