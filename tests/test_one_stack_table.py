"""conftest.ONE_STACK names tests that exist: a renamed or removed test cannot leave an entry that
skips nothing (or, as a prefix, something else) on the Python 3.12 stack."""

import ast
import os

from conftest import ONE_STACK, one_stack_reason

HERE = os.path.dirname(os.path.abspath(__file__))


def _functions(module: str) -> set[str]:
    with open(os.path.join(HERE, module)) as f:
        tree = ast.parse(f.read())
    return {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}


def test_every_entry_names_a_module_and_a_test_prefix_in_it():
    for entry in ONE_STACK:
        module, _, test = entry.partition("::")
        assert os.path.exists(os.path.join(HERE, module)), entry
        if test:
            name = test.split("[")[0]
            assert any(f.startswith(name) and f.startswith("test_") for f in _functions(module)), entry


def test_a_node_id_finds_its_entry_by_prefix():
    assert one_stack_reason("tests/test_harness.py::test_cli_runs_local_tasks_offline_and_writes_json")
    assert one_stack_reason("tests/test_train_objectives.py::test_a_sharded_mesh_equals_one_device[dpo]")
    assert one_stack_reason("tests/test_train_objectives.py::test_a_sharded_mesh_equals_one_device[sft]") is None
    assert one_stack_reason("tests/test_model.py::test_anything") is None
