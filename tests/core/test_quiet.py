"""specdistill/core/quiet.py: the commands hide vLLM's notices about the machine by log level, in this process and in
the engine processes (through VLLM_LOGGING_CONFIG_PATH), while errors and every other logger's warnings still show;
--verbose / SPECDISTILL_VERBOSE=1 and a user's own settings leave everything as it is."""

import os
import subprocess
import sys

from tests.cli import REPO

# In a fresh interpreter (the settings are process-wide): apply what an engine process reads, then log.
ENGINE_PROCESS = """
import json, logging.config, os
from specdistill.core.quiet import quiet_libraries
quiet_libraries()
path = os.environ.get("VLLM_LOGGING_CONFIG_PATH")
if path:
    logging.config.dictConfig(json.load(open(path)))
logging.getLogger("vllm.platforms.cpu").warning("NOISE: triton-cpu is expected on x86 CPUs")
logging.getLogger("vllm.v1.worker.cpu_worker").warning("NOISE: libtcmalloc is not found in LD_PRELOAD")
logging.getLogger("vllm.platforms.cpu").error("SHOWN: an error of a quieted logger")
logging.getLogger("vllm.config.model").warning("SHOWN: Casting torch.float16 to torch.bfloat16.")
print("TRANSFORMERS_VERBOSITY", os.environ.get("TRANSFORMERS_VERBOSITY"))
"""


def _engine_output(**env) -> str:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_LOGGING", "SPECDISTILL_VERBOSE",
                                                                       "TRANSFORMERS_VERBOSITY"))}
    proc = subprocess.run([sys.executable, "-c", ENGINE_PROCESS], cwd=REPO, env={**clean, **env},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout + proc.stderr


def test_machine_notices_are_hidden_and_errors_and_other_warnings_show():
    out = _engine_output()
    assert "NOISE" not in out
    assert "SHOWN: an error of a quieted logger" in out and "SHOWN: Casting" in out
    assert "TRANSFORMERS_VERBOSITY error" in out


def test_verbose_shows_everything():
    out = _engine_output(SPECDISTILL_VERBOSE="1")
    assert out.count("NOISE") == 2 and "TRANSFORMERS_VERBOSITY None" in out


def test_a_users_own_vllm_log_level_is_kept():
    out = _engine_output(VLLM_LOGGING_LEVEL="INFO")  # no config file of ours then: the user's level rules vLLM
    assert out.count("NOISE") == 2
