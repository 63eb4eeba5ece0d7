"""Docs name only what exists: every `specdistill-COMMAND` / `python -m MODULE` / `python SCRIPT.py` command quoted in
README.md and docs/ names a real console script (pyproject.toml), module or script, its `--flags` are the script's own,
and every `key=value` it gives the train, ray_job or regenerate entry points is a real config group option or key."""

import importlib.util
import re
import shlex
import tomllib
from pathlib import Path

import pytest
from hydra._internal.utils import get_args_parser
from omegaconf import OmegaConf

from tests.cli import REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
COMMAND = re.compile(r"(?:python3? (?P<target>-m [\w.]+|[\w/]+\.py)|(?<![\w/.-])(?P<script>specdistill-[a-z][\w-]*))"
                     r"(?P<args>[^`|]*)")
HYDRA_ENTRY_POINTS = ("specdistill.launch.train", "specdistill.launch.ray_job")
HYDRA_FLAGS = {o for a in get_args_parser()._actions for o in a.option_strings}  # --config-dir, --cfg, --info, ...
COMMON_FLAGS = (REPO / "specdistill" / "launch" / "command.py").read_text()  # --version, --verbose of every command
# console script -> "-m MODULE" (pyproject.toml [project.scripts])
SCRIPTS = {name: "-m " + entry.split(":")[0]
           for name, entry in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"].items()}


def quoted_commands() -> list[tuple[str, str, list[str]]]:
    """(doc:line, module or script, argument tokens) for every command in the docs; continued lines joined."""
    found = []
    for doc in DOCS:
        lines = doc.read_text().splitlines()
        i = 0
        while i < len(lines):
            line, start = lines[i], i
            while line.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                line = line.rstrip()[:-1] + " " + lines[i]
            for m in COMMAND.finditer(line):
                args = m.group("args").split("#")[0]
                args = re.sub(r"(?<![=\[,])\[[^\]]*\]", " ", args)  # [optional] parts: placeholders (not key=[a,b])
                where = f"{doc.relative_to(REPO)}:{start + 1}"
                if m.group("script"):
                    assert m.group("script") in SCRIPTS, f"{where}: no console script {m.group('script')}"
                found.append((where, m.group("target") or SCRIPTS[m.group("script")], _split(args)))
            i += 1
    return found


def _split(args: str) -> list[str]:
    """Shell words ('drafters=[a,{b:c}]' is one); an unbalanced quote (prose) falls back to whitespace."""
    try:
        return shlex.split(args)
    except ValueError:
        return args.split()


COMMANDS = quoted_commands()


def _source(target: str) -> Path:
    if target.startswith("-m "):
        spec = importlib.util.find_spec(target[3:])
        assert spec is not None and spec.origin, f"no module {target[3:]}"
        return Path(spec.origin)
    return REPO / target


def _is_placeholder(value: str) -> bool:
    return value in ("...", "N", "DIR", "FILE") or value.isupper() or "<" in value or value.startswith("/")


def _hydra_problems(args: list[str]) -> list[str]:
    """Group options that have no conf file, dotted keys the composed config lacks."""
    from specdistill.launch.config import compose_config

    conf = REPO / "specdistill" / "conf"
    problems, groups, keys, values = [], [], [], []
    users_dir = "--config-dir" in args  # group options may be the user's own files there (docs/launching.md)
    for arg in args:
        if "=" not in arg or arg.startswith(("-", "hydra.", "+")):
            continue
        key, value = arg.split("=", 1)
        if "." in key:
            keys.append(key)
            continue
        if not (conf / key).is_dir():  # a top-level key (drafters=[...]): the composed config must take it
            values.append(arg)
            continue
        for option in value.split(","):  # a sweep: a,b
            if users_dir and not (conf / key / f"{option}.yaml").is_file():
                continue
            if not _is_placeholder(option) and not (conf / key / f"{option}.yaml").is_file():
                problems.append(f"{key}={option}: no specdistill/conf/{key}/{option}.yaml")
            elif not _is_placeholder(option):
                groups.append(f"{key}={option}")
    cfg = compose_config(list(dict.fromkeys(groups)) + values)
    for key in keys:
        if OmegaConf.select(cfg, key, default="<missing>") == "<missing>":
            problems.append(f"{key}: no such config key")
    if cfg.drafters:  # every entry names a drafter and its real fields (specdistill/trainer/entries.py)
        from specdistill.trainer.config import TrainerConfig
        from specdistill.trainer.entries import resolve_entries

        try:
            resolve_entries(OmegaConf.to_container(cfg.drafters), None, TrainerConfig())
        except ValueError as err:
            problems.append(f"drafters: {err}")
    return problems


@pytest.mark.parametrize("where, target, args", COMMANDS, ids=[f"{w} {t}" for w, t, _ in COMMANDS])
def test_a_quoted_command_names_what_exists(where, target, args):
    source = _source(target)
    assert source.is_file(), f"{where}: {target} does not exist"
    text = source.read_text()
    module = target[3:] if target.startswith("-m ") else None
    own = HYDRA_FLAGS if module in HYDRA_ENTRY_POINTS else {"--help"}  # argparse's --help is every command's
    flags = [a.split("=")[0] for a in args if a.startswith("--")]
    problems = [f"{f}: not a flag of {target}" for f in flags if f'"{f}"' not in text + COMMON_FLAGS and f not in own]
    if module in HYDRA_ENTRY_POINTS:
        problems += _hydra_problems(args)
    elif module == "specdistill.launch.regenerate":
        from dataclasses import fields

        from specdistill.launch.regenerate import RegenerateConfig

        names = {f.name for f in fields(RegenerateConfig)}
        problems += [f"{a}: not a specdistill.launch.regenerate setting" for a in args
                     if "=" in a and a.split("=")[0].split(".")[0] not in names]
    assert not problems, f"{where}: {problems}"


def test_the_docs_quote_the_main_commands():
    targets = {t for _, t, _ in COMMANDS}
    assert {"-m specdistill.launch.train", "-m specdistill.launch.regenerate", "bench/data.py", "bench/quality.py"} <= targets


def test_the_console_scripts_run_from_any_directory(tmp_path):
    """`specdistill-train --cfg job` from outside the checkout: the editable install's command composes the config."""
    import subprocess
    import sys

    script = Path(sys.executable).parent / "specdistill-train"
    assert script.is_file(), f"{script}: the console scripts are not installed (pip install -e .)"
    proc = subprocess.run([str(script), "--cfg", "job", "drafter=eagle3"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "name: eagle3" in proc.stdout


OVERRIDE = re.compile(r"`((?:data|drafter|feature_server|logger|trainer|target)(?:\.\w+)+)=[^` ]*`")


def test_every_override_quoted_in_the_docs_is_a_config_key():
    """`group.key=value` spans in prose name real keys (drafter keys: of some drafter's schema)."""
    from dataclasses import fields

    from specdistill.drafters import DRAFTERS

    quoted = {m.group(1) for doc in DOCS for m in OVERRIDE.finditer(doc.read_text())}
    assert "trainer.muon_scope" in quoted  # the pattern sees the docs' overrides
    drafter_keys = {f.name for config_cls, _ in DRAFTERS.values() for f in fields(config_cls)}
    other = [k for k in quoted if not k.startswith("drafter.")]
    problems = [k for k in quoted if k.startswith("drafter.") and k.split(".", 1)[1] not in drafter_keys]
    problems += [p for p in _hydra_problems([f"{k}=x" for k in other])]
    assert not problems, problems
