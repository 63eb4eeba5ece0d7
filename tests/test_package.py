"""One importable package: nothing of specdistill claims a generic top-level name (`kernels`, `data`, `core`, ...)
in a user's environment, and Hugging Face's `kernels` package (installed by the test extra) works beside it."""

import subprocess
import sys
import tomllib

from tests.cli import REPO

COMPONENTS = ("core", "data", "drafters", "evaluation", "feature_server", "kernels", "launch", "trainer")


def test_the_components_live_under_specdistill_only():
    found = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    assert found["include"] == ["specdistill*"]
    assert not [c for c in COMPONENTS if (REPO / c).exists()], "a component directory at the repository root"
    assert all((REPO / "specdistill" / c / "__init__.py").is_file() for c in COMPONENTS)


def test_hugging_face_kernels_imports_and_a_model_loads_from_the_repository_root():
    """The failure this move fixed: from the repo root, `kernels` resolved to the repo's own folder and transformers'
    hub-kernels integration raised `ImportError: cannot import name 'CUDAProperties' from 'kernels'`."""
    code = ("import kernels, transformers.integrations.hub_kernels as hub\n"
            "from transformers import AutoModelForCausalLM\n"
            "assert 'site-packages' in kernels.__file__, kernels.__file__\n"
            "m = AutoModelForCausalLM.from_pretrained('specdistill/launch/assets/small-real')\n"
            "import specdistill.kernels.moe, specdistill.launch.train\n"
            "print('loaded', type(m).__name__)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "loaded LlamaForCausalLM" in proc.stdout
