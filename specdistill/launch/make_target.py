"""Build a tiny target checkpoint.

    specdistill-make-target NAME DIR [--fit-steps N]    # NAME in specdistill.launch.targets.TINY_TARGETS
    specdistill-make-target small-real DIR [--fit-steps N]  # pretrained on real text (specdistill/launch/small_real.py)

Tiny targets: --fit-steps 0 keeps the random init (greedy outputs then loop on one token); the default fits the
target on the synthetic workload for the spec's step count (<= ~60 s on 2 cores). small-real: --fit-steps N stops
pretraining after N steps (the default is the full schedule, ~1 h on 2 cores; its result is committed).
"""

import argparse
import time

from specdistill.launch.command import common_flags, start
from specdistill.launch.small_real import make_small_real
from specdistill.launch.targets import TINY_TARGETS, make_target, target_summary

BUILDERS = ["small-real", *TINY_TARGETS]


def main(argv: list[str] | None = None) -> None:
    p = common_flags(argparse.ArgumentParser(description="Build a tiny target checkpoint (deterministic)."))
    p.add_argument("name", help=f"one of: {', '.join(BUILDERS)}")
    p.add_argument("out_dir")
    p.add_argument("--fit-steps", type=int, default=None, help="0 = random init; default: the spec's count")
    a = start(p.parse_args(argv))
    if a.name not in BUILDERS:
        p.error(f"unknown target {a.name!r}; valid names: {', '.join(BUILDERS)}")
    t0 = time.perf_counter()
    if a.name == "small-real":
        out = make_small_real(a.out_dir, steps=a.fit_steps)
    else:
        out = make_target(a.name, a.out_dir, fit_steps=a.fit_steps)
    print(f"wrote {out} in {time.perf_counter() - t0:.1f} s: {target_summary(out)}")


if __name__ == "__main__":
    main()
