"""The package's layers import downwards only (docs/architecture.md draws them):

  base (errors, config, cli, ...) <- model, parallel <- data <- checkpoints <- infer <- engine <- serve
  <- the top: train, harness, convert, planner and the CLIs (generate, evaluate, ...)

A module may import its own layer and those below it, never one above: model knows nothing of data,
data nothing of checkpoints, infer nothing of convert or train, the engine nothing of the HTTP
server. The top's packages may import one another but not in a circle (and train not the planner).
Read from the sources' import statements, module level and inside functions alike; the folders'
import graph (each top-level module a node of its own) has no circle.
"""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "zaya_jax"

LAYERS = (  # bottom first; a module may import only modules of its own layer or one below
    ("base", ("errors", "config", "cli", "jax_versions", "hardware", "launch_defaults", "native")),
    ("model", ("model", "parallel")),       # the text model, the vision tower and ZayaVL; beside it
    #                                         parallel/: the mesh, the rules table, the sharded kernels
    ("data", ("data", "config_files")),     # tokenizer, pipeline, image rows; config files -> configs
    ("checkpoints", ("checkpoints",)),      # Orbax and HF formats, ModelParts, the carried tokenizer
    ("infer", ("infer",)),
    ("engine", ("engine",)),
    ("serve", ("serve",)),
    ("top", ("train", "harness", "convert", "planner", "evaluation", "generate", "evaluate", "evaluate_tasks",
             "preference_pairs", "__init__")),
)
# Files whose layer is not their folder's: a CLI that keeps its `python -m` name inside a lower folder.
FILE_LAYERS = {"parallel/check.py": "top"}  # python -m zaya_jax.parallel.check: builds a model from a config file
TOP_FORBIDDEN = {"train": ("planner",)}  # within the top: the planner reads the trainer, not the reverse
# parallel/ sits beside model/ as one node of the folder graph: model's layers take parallel's rules and
# mesh context, and parallel's sharded MoE kernels call model's dispatch. config_files.py (run config
# files -> ModelConfig, VisionConfig, ImageProcessor) is data-layer code outside the folder, read by data's chat rows.
BESIDE = {"parallel": "model", "config_files": "data"}
RANK = {name: i for i, (name, _) in enumerate(LAYERS)}
UNIT_LAYER = {unit: layer for layer, units in LAYERS for unit in units}


def unit_of(rel: str) -> str:
    """'model/zaya.py' -> 'model', 'generate.py' -> 'generate'."""
    parts = rel.split("/")
    return parts[0] if len(parts) > 1 else parts[0][:-3]


def node_of(rel: str) -> str:
    """The node of the folder graph: the folder (or top-level module), a FILE_LAYERS file by itself,
    BESIDE's as their neighbour."""
    if rel in FILE_LAYERS:
        return rel
    unit = unit_of(rel)
    return BESIDE.get(unit, unit)


def layer_of(rel: str) -> str:
    if rel in FILE_LAYERS:
        return FILE_LAYERS[rel]
    unit = unit_of(rel)
    assert unit in UNIT_LAYER, f"zaya_jax/{rel}: its folder is in no layer; add it to LAYERS"
    return UNIT_LAYER[unit]


def module_file(name: str) -> str | None:
    """'zaya_jax.model.zaya' -> 'model/zaya.py' (a package -> its __init__.py); None outside zaya_jax."""
    parts = name.split(".")
    if parts[0] != "zaya_jax":
        return None
    for n in range(len(parts), 1, -1):  # the longest prefix that is a file (`from pkg import module` included)
        path = PACKAGE.joinpath(*parts[1:n])
        if path.with_suffix(".py").is_file():
            return str(path.with_suffix(".py").relative_to(PACKAGE))
        if (path / "__init__.py").is_file():
            return str((path / "__init__.py").relative_to(PACKAGE))
    return "__init__.py"


def imported_modules(path: pathlib.Path) -> set[str]:
    """Every absolute import of `path`, module level and inside functions; `from a import b` gives a.b too."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            if node.module != "zaya_jax":  # `from zaya_jax import cli` imports cli, not the package's __init__
                names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def arrows() -> set[tuple[str, str, str]]:
    """(importing file, imported module, imported file) of every import of one zaya_jax file by another."""
    found = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = str(path.relative_to(PACKAGE))
        for name in imported_modules(path):
            target = module_file(name)
            if target is not None and target != rel:
                found.add((rel, name, target))
    return found


def upward(found) -> set[str]:
    bad = set()
    for rel, name, target in found:
        here, there = layer_of(rel), layer_of(target)
        if RANK[there] > RANK[here] or unit_of(target) in TOP_FORBIDDEN.get(unit_of(rel), ()):
            bad.add(f"zaya_jax/{rel} ({here}) imports zaya_jax/{target} ({there})")
    return bad


def circles(found) -> list[list[str]]:
    """Each circle of the folder graph (a strongly connected set of more than one node), sorted."""
    graph = {}
    for rel, _, target in found:
        a, b = node_of(rel), node_of(target)
        if a != b:
            graph.setdefault(a, set()).add(b)
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def test_every_layer_imports_only_itself_and_below():
    bad = upward(arrows())
    assert not bad, "\n".join(sorted(bad))


def test_the_folders_import_no_circle():
    found = circles(arrows())
    assert not found, [" <-> ".join(c) for c in found]


@pytest.mark.parametrize("source, imported", [
    ("model/x.py", "zaya_jax.data.tokenizer"), ("data/x.py", "zaya_jax.checkpoints.orbax_checkpoint"),
    ("infer/x.py", "zaya_jax.convert.conversions"), ("infer/x.py", "zaya_jax.train.checkpoint"),
    ("parallel/x.py", "zaya_jax.data.packing"), ("checkpoints/x.py", "zaya_jax.infer.loading"),
    ("model/x.py", "zaya_jax.data.vision.processor"), ("data/x.py", "zaya_jax.evaluation.digit_accuracy"),
    ("engine/x.py", "zaya_jax.serve.service"), ("train/x.py", "zaya_jax.planner.step_plan"),
])
def test_an_upward_arrow_is_refused(source, imported):
    """The checks themselves: one upward import (or a circle) of a file that is not there is found."""
    arrow = (source, imported, module_file(imported))
    assert upward({arrow}) == {f"zaya_jax/{source} ({layer_of(source)}) imports zaya_jax/{arrow[2]} ({layer_of(arrow[2])})"}
    assert circles({arrow, ("infer/y.py", "zaya_jax.checkpoints.hf_load", "checkpoints/hf_load.py"),
                    ("checkpoints/y.py", "zaya_jax.infer.loading", "infer/loading.py")}) == [["checkpoints", "infer"]]


def test_the_planner_is_one_package_with_its_cli():
    modules = {p.stem for p in (PACKAGE / "planner").glob("*.py")}
    assert {"__main__", "step_plan", "step_flops", "step_time", "phase_plan", "mesh_search"} <= modules
    assert not any((PACKAGE / "parallel" / f"{m}.py").exists() for m in modules - {"__init__"})
