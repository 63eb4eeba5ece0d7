"""Imports run one way (README.md "Layout"): each package imports only the packages below it, lazily or not."""

import ast

import pytest

from tests.cli import REPO

# package -> the repository packages it may import; bench/ sits on top and may import any.
ALLOWED = {
    "core": set(),
    "kernels": set(),
    "data": {"core"},
    "drafters": {"core", "kernels"},
    "feature_server": {"core"},
    "evaluation": {"core", "data", "drafters", "feature_server"},
    "trainer": {"core", "kernels", "data", "drafters", "feature_server", "evaluation"},
    "launch": {"core", "kernels", "data", "drafters", "feature_server", "evaluation", "trainer"},
}
PACKAGES = {*ALLOWED, "bench"}


def _component(module: str) -> str:
    """specdistill.trainer.feed -> trainer; bench.x -> bench."""
    parts = module.split(".")
    return parts[1] if parts[0] == "specdistill" and len(parts) > 1 else parts[0]


def imported_packages(path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(_component(alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(_component(node.module))
    return found & PACKAGES


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_a_package_imports_only_the_packages_below_it(package):
    files = sorted((REPO / "specdistill" / package).rglob("*.py"))
    assert files, f"{package}/ has no modules"
    wrong = {f"{path.relative_to(REPO)} imports {sorted(bad)}"
             for path in files if (bad := imported_packages(path) - ALLOWED[package] - {package})}
    assert not wrong, f"{package}/ may import only {sorted(ALLOWED[package])}: {sorted(wrong)}"
