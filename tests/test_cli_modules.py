"""Each name means one thing: the CLI modules (every `__main__.py` and the top-level modules run as
`python -m zaya_jax.<name>`) hold their flags and call library code, so no zaya_jax module imports
one; no package binds a name that is also one of its submodules (a function the submodule's import
would shadow); the library's one `generate` is zaya_jax.engine.generate. Read from the sources'
import statements (module level and inside functions)."""

import ast
import importlib
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "zaya_jax"


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def runs_as_main(tree: ast.Module) -> bool:
    """The module has an `if __name__ == "__main__":` block."""
    return any(isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
               and isinstance(node.test.left, ast.Name) and node.test.left.id == "__name__"
               and any(isinstance(c, ast.Constant) and c.value == "__main__" for c in node.test.comparators)
               for node in tree.body)


def cli_modules() -> set[str]:
    """Every zaya_jax/**/__main__.py, and each top-level zaya_jax/*.py with a __main__ block."""
    mains = {module_name(p) for p in PACKAGE.rglob("__main__.py")}
    top = {module_name(p) for p in PACKAGE.glob("*.py") if runs_as_main(ast.parse(p.read_text()))}
    return mains | top


def imported_modules(tree: ast.Module) -> set[str]:
    """The modules an import statement may load: `import a.b`, `from a import b` (a, and a.b)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_the_cli_modules_are_found():
    assert {"zaya_jax.generate", "zaya_jax.evaluate", "zaya_jax.evaluate_tasks", "zaya_jax.preference_pairs",
            "zaya_jax.train.__main__", "zaya_jax.serve.__main__", "zaya_jax.convert.__main__",
            "zaya_jax.harness.__main__", "zaya_jax.planner.__main__"} <= cli_modules()


def test_no_zaya_jax_module_imports_a_cli_module():
    clis = cli_modules()
    found = {f"{path.relative_to(PACKAGE.parent)}: {name}"
             for path in sorted(PACKAGE.rglob("*.py"))
             for name in imported_modules(ast.parse(path.read_text()))
             if name in clis and name != module_name(path)}
    assert not found, sorted(found)


def bound_names(tree: ast.Module) -> set[str]:
    """Names a module binds at its top level (functions, classes, imports, assignments)."""
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


def test_no_package_binds_the_name_of_one_of_its_submodules():
    shadowed = set()
    for init in sorted(PACKAGE.rglob("__init__.py")):
        submodules = {p.stem for p in init.parent.glob("*.py")} | {p.name for p in init.parent.iterdir()
                                                                    if (p / "__init__.py").exists()}
        for name in bound_names(ast.parse(init.read_text())) & (submodules - {"__init__", "__main__"}):
            imports_itself = f"{module_name(init)}.{name}"  # `from pkg import sub` binds the submodule itself
            if importlib.import_module(module_name(init)).__dict__.get(name) is not importlib.import_module(
                    imports_itself):
                shadowed.add(f"{module_name(init)}.{name}")
    assert not shadowed, sorted(shadowed)


def test_the_one_generate_is_the_engines_and_the_cli_is_a_plain_module():
    import zaya_jax
    import zaya_jax.engine
    import zaya_jax.infer
    from zaya_jax.engine.batch import generate

    cli = importlib.import_module("zaya_jax.generate")
    assert zaya_jax.engine.generate is generate and callable(generate)
    assert zaya_jax.generate is cli and not callable(cli)
    assert not hasattr(zaya_jax.infer, "generate")
