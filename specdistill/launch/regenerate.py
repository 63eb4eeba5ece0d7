"""Your prompts and conversations, the target's answers (specdistill/data/regenerate.py has the details):

    specdistill-regenerate target.path=DIR|target=NAME input=chats.jsonl output=train.jsonl \
        [turns=all|last] [shard=I/N] [backend=auto|vllm|hf] [max_new_tokens=256] [temperature=0] [top_p=1] \
        [stop=[...]] [batch_size=32] [seed=0] \
        ['chat_template_kwargs={enable_thinking: false}']   # the same as the training run's data.chat_template_kwargs
    specdistill-regenerate output=train.jsonl merge=N       # after shard=0/N ... shard=N-1/N: one file, input order

Prints a JSON summary last (rows written, rows/s, backend). Re-running with the same output resumes.
"""

import json
import logging
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path

from omegaconf import OmegaConf

from specdistill.data.regenerate import RegenerateSettings, merge_shards, regenerate
from specdistill.launch.command import own_flags
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
    if cfg.merge is not None and OmegaConf.is_missing(cfg, "input"):
        cfg.input = ""  # merge=N reads the shards' files, not the input
    for key in ("input", "output"):
        if OmegaConf.is_missing(cfg, key) or cfg[key] == "???":
            raise SystemExit(f"specdistill.launch.regenerate: {key}=FILE is required (usage: see the module docstring)")
    return OmegaConf.to_object(cfg)


def run(cfg: RegenerateConfig) -> dict:
    from specdistill.launch.prepare import resolve_target

    if cfg.merge is not None:
        return merge_shards(cfg.output, cfg.merge)
    target_dir = resolve_target(cfg.target, Path(cfg.cache_dir))
    settings = RegenerateSettings(**{f.name: getattr(cfg, f.name) for f in fields(RegenerateSettings)})
    # the input's digest (resume checks) memoised with the token store's: a restart does not re-read a large input
    return regenerate(target_dir, settings, memo_dir=Path(cfg.cache_dir) / "tokens" / "digests")


def main(argv: list[str] | None = None) -> None:
    argv = own_flags(sys.argv[1:] if argv is None else argv, __doc__)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    summary = run(parse(argv))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
