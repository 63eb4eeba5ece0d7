"""Imports run one way (README.md "Layout"): each package imports only the packages below it, lazily or not."""

import ast
import re

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


def _bench_imports(path) -> set[str]:
    """The bench modules a bench script imports, at its top or inside a function (bench.x, `from bench import x`)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name.split(".")[1] for a in node.names if a.name.startswith("bench."))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.startswith("bench."):
                found.add(node.module.split(".")[1])
            elif node.module == "bench":
                found.update(a.name for a in node.names)
    return found


def test_the_bench_scripts_import_each_other_without_a_circle():
    """Shared shapes live in a module of their own (bench/production_target.py), not in a script that imports its
    importer back (bench/drafter_steps.py <-> bench/step_flops.py was one)."""
    graph = {p.stem: _bench_imports(p) for p in sorted((REPO / "bench").glob("*.py"))}
    done, path = set(), []

    def visit(module: str) -> None:
        if module in path:
            raise AssertionError(f"import circle: {' -> '.join(path[path.index(module):] + [module])}")
        if module in done:
            return
        path.append(module)
        for imported in sorted(graph.get(module, ())):
            visit(imported)
        path.pop()
        done.add(module)

    for module in graph:
        visit(module)


WALKS_UP = re.compile(r"__file__.*(\.parents\[|\.parent\.parent)|dirname\(os\.path\.dirname\(.*__file__")


def test_no_module_of_the_package_looks_outside_it_through_its_own_path():
    """What the package reads at run time ships inside it (pyproject.toml package data, tests/test_wheel.py): no
    module finds a file by walking up from `__file__` to the repository."""
    walking = [f"{p.relative_to(REPO)}:{i}" for p in sorted((REPO / "specdistill").rglob("*.py"))
               for i, line in enumerate(p.read_text().splitlines(), 1) if WALKS_UP.search(line)]
    assert not walking, f"{walking}: read package files with importlib.resources (specdistill/launch/assets.py)"
