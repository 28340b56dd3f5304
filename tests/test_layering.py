"""The package layers import downwards only: parallel/ (mesh, rules, collectives, sharded kernels)
and model/ know nothing of the trainer or the planner, train/ nothing of the planner, infer/ nothing
of the serving engine built on it,
the engine nothing of the HTTP server built on it. Read from
the sources' import statements (module level and inside functions)."""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "zaya_jax"
# package -> the packages above it, which it must not import
FORBIDDEN = {"parallel": ("zaya_jax.train", "zaya_jax.planner"), "model": ("zaya_jax.train", "zaya_jax.planner"),
             "train": ("zaya_jax.planner",), "infer": ("zaya_jax.engine", "zaya_jax.serve"),
             "engine": ("zaya_jax.serve",)}


def imported_modules(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_upward_imports(package):
    upward = {f"{path.relative_to(PACKAGE.parent)}: {name}"
              for path in sorted((PACKAGE / package).rglob("*.py"))
              for name in imported_modules(path)
              if name.startswith(FORBIDDEN[package])}
    assert not upward, sorted(upward)


def test_the_planner_is_one_package_with_its_cli():
    modules = {p.stem for p in (PACKAGE / "planner").glob("*.py")}
    assert {"__main__", "step_plan", "step_flops", "step_time", "phase_plan", "mesh_search"} <= modules
    assert not any((PACKAGE / "parallel" / f"{m}.py").exists() for m in modules - {"__init__"})
