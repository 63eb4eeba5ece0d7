"""Your prompts, the target's answers (specdistill/data/regenerate.py has the details):

    specdistill-regenerate target.path=DIR|target=NAME input=prompts.jsonl output=train.jsonl \
        [backend=auto|vllm|hf] [max_new_tokens=256] [temperature=0] [top_p=1] [stop=[...]] [batch_size=32] [seed=0]

Prints a JSON summary last (rows written, rows/s, backend). Re-running with the same output resumes.
"""

import json
import logging
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path

from omegaconf import OmegaConf

from specdistill.data.regenerate import RegenerateSettings, regenerate
from specdistill.launch.config import TargetConfig


@dataclass
class RegenerateConfig(RegenerateSettings):
    target: TargetConfig = field(default_factory=TargetConfig)
    cache_dir: str = ".cache/specdistill"


def parse(argv: list[str]) -> RegenerateConfig:
    # target=NAME as in specdistill.launch.train (a committed or tiny target's name); target.path=DIR for any checkpoint
    argv = [f"target.name={a.split('=', 1)[1]}" if a.startswith("target=") else a for a in argv]
    schema = OmegaConf.structured(RegenerateConfig)
    cfg = OmegaConf.merge(schema, OmegaConf.from_dotlist(argv))  # unknown keys fail here, naming the key
    for key in ("input", "output"):
        if OmegaConf.is_missing(cfg, key) or cfg[key] == "???":
            raise SystemExit(f"specdistill.launch.regenerate: {key}=FILE is required (usage: see the module docstring)")
    return OmegaConf.to_object(cfg)


def run(cfg: RegenerateConfig) -> dict:
    from specdistill.launch.prepare import resolve_target

    target_dir = resolve_target(cfg.target, Path(cfg.cache_dir))
    settings = RegenerateSettings(**{f.name: getattr(cfg, f.name) for f in fields(RegenerateSettings)})
    return regenerate(target_dir, settings)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    summary = run(parse(sys.argv[1:] if argv is None else argv))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
