"""Test bootstrap: 8 fake CPU devices, absl flags parsed (Grain workers), a compilation cache, jax's
in-memory caches freed after each test module (a worker's memory mappings stay bounded); tests
marked `torch_reference` (they compare with PyTorch transformers) skipped, so counted, where
torch or transformers is not installed (the Python 3.12 run: the registry's torch there is a
multi-GB CUDA build). Everywhere else they run, and a missing torch fails them.

The tests of ONE_STACK run on the Python 3.11 stack (jax 0.10.2) only and are skipped, so counted,
on the others: what each proves is the project's own logic above jax (a CLI's messages, lm-eval's
glue, Grain's data order, a loss against numpy, the planner's arithmetic), which the jax version
does not change; the jax API it goes through (lowering, sharding, Pallas, Orbax, the optimizer,
multi-process start-up) is proven on both stacks by the tests left out of the table
(docs/testing.md)."""

import importlib.util
import os
import sys

from fake_devices import COMPILATION_CACHE, FAKE_DEVICES

os.environ.setdefault("XLA_FLAGS", FAKE_DEVICES)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from absl import flags  # noqa: E402

if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()

import jax  # noqa: E402
import pytest  # noqa: E402
from _pytest.nodes import Node  # noqa: E402

jax.config.update("jax_compilation_cache_dir", COMPILATION_CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """jax.clear_caches() after each module. Every program XLA:CPU compiles or loads keeps about
    three memory mappings while jax's caches hold it; without this a 3.12 worker (jax 0.11.2) reached
    Linux's default vm.max_map_count (65,530) some 160 tests into the run and segfaulted in the next
    program's load (docs/testing.md, benchmarks/ci/worker_mappings.py)."""
    yield
    jax.clear_caches()


HAS_TORCH_REFERENCE = all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers"))
WITHOUT_TORCH = pytest.mark.skip(reason="left out: compares with PyTorch transformers, and torch or transformers "
                                        "is not installed")


# node id below tests/ (a module, or a module::test prefix) -> why it need not run on both stacks
ONE_STACK = {
    "test_harness.py": "lm-eval's glue and scoring over the model (model, sharding and multi-process start-up "
                       "are proven on both stacks by test_model, test_parallel and test_multihost)",
    "test_train_objectives.py::test_dpo": "the DPO loss against numpy and DPO data (the train step runs on both)",
    "test_train_objectives.py::test_sft": "the SFT loss against a hand count",
    "test_train_objectives.py::test_resume_after_sigkill": "post-training resume (Orbax resume is proven on both "
                                                           "by test_train_cli and test_proof_kill_after_commit)",
    "test_train_objectives.py::test_a_sharded_mesh_equals_one_device[dpo]": "DPO on a mesh ([sft] runs on both)",
    "test_train_objectives.py::test_init_from": "init_from_checkpoint's choice of weights",
    "test_cli_handoffs.py": "the CLIs' messages and phase hand-offs",
    "test_cli_errors.py": "the CLIs' error messages",
    "test_proof_local_tier.py::test_bad_local_tier_input": "the local tier's refusals (its saves and restores run "
                                                           "on both: the file's other tests)",
    "test_proof_local_tier.py::test_a_local_step_from_another_config": "a refused local resume (its message)",
    "test_cli_convert.py": "convert's refusals and read-back messages",
    "test_config_and_loading_errors.py": "config and loading error messages",
    "test_config_overrides.py": "ml_collections overrides",
    "test_infer_cli.py": "generate's flags and messages (decoding runs on both: test_infer_decode, _generate)",
    "test_posttrain_demo.py": "the post-training demo's data and CLI chain",
    "test_posttrain_handoffs.py": "post-training's CLI hand-offs and exports",
    "test_posttrain_batches.py": "post-training batch assembly (numpy)",
    "test_infer_notebook.py": "the notebook's cells, which call the APIs tested on both stacks",
    "test_proof_pipeline_resume.py": "Grain's data order across a resume (the same grain on both stacks)",
    "test_proof_quantized_trained.py": "weight-only quantization's error on a trained model",
    "test_plan_time.py": "the planner's time model (arithmetic; its XLA cross-checks, test_plan_flops, run on both)",
    "test_data_demo.py": "the demo corpus",
    "test_data_packing.py": "sequence packing (numpy)",
    "test_data_pipeline.py": "the Grain pipeline (the same grain on both stacks)",
    "test_data_prepare.py": "data.prepare",
    "test_chat_data.py": "chat templates and masks",
    "test_instruction_tasks.py": "the generated tasks",
    "test_proof_benchmark_results.py": "the committed results files against the docs",
    "test_gradient_reduce.py::test_bfloat16_on_the_wire": "30 demo steps' losses with bf16 reduction (its "
                                                          "lowered collectives and float32-by-hand proofs run on both)",
    "test_train_cli.py::test_a_restart_names": "a restart's refusal messages",
}
FIRST_STACK = sys.version_info[:2] == (3, 11)


def one_stack_reason(nodeid: str) -> str | None:
    """Why the test `nodeid` (tests/...) runs on the 3.11 stack only, or None."""
    below_tests = nodeid.split("/", 1)[-1]
    return next((why for prefix, why in ONE_STACK.items() if below_tests.startswith(prefix)), None)


def pytest_configure(config):
    """`--dist loadgroup` (pyproject.toml) needs a pytest whose node ids xdist can suffix with the group:
    xdist 3.8 writes `item._nodeid`, which pytest 9.2 no longer reads, and then every group is silently
    ignored (the multi-process tests overlap, module fixtures are built on both workers)."""
    config.addinivalue_line("markers", "torch_reference: compares with PyTorch transformers (needs torch)")
    if config.getoption("dist", None) == "loadgroup" and "_nodeid" not in Node.__slots__:
        raise pytest.UsageError(f"pytest {pytest.__version__} ignores pytest-xdist's test groups "
                                "(--dist loadgroup): install the pytest that pyproject.toml pins")


def xdist_group_of(item) -> str | None:
    """The item's xdist_group marker's name, or None."""
    mark = item.get_closest_marker("xdist_group")
    return None if mark is None else str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))


def group_modules_by_their_fixtures(items) -> None:
    """Put the tests of a module that share a module-scoped fixture (a trained run, an export) on one
    xdist worker, so that it is built once: `--dist loadgroup` otherwise spreads a module's tests over
    both workers, and each builds the module's fixtures. Where one of those tests is already in a
    group (the multiprocess lane), the others join it."""
    sharing: dict[str, list] = {}
    for item in items:
        definitions = getattr(item, "_fixtureinfo", None)
        if definitions and any(d and d[-1].scope == "module" for d in definitions.name2fixturedefs.values()):
            sharing.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    for module, shared in sharing.items():
        if len(shared) < 2:
            continue
        groups = sorted({g for g in map(xdist_group_of, shared) if g})
        group = groups[0] if groups else os.path.basename(module).removesuffix(".py")
        for item in shared:
            if xdist_group_of(item) is None:
                item.add_marker(pytest.mark.xdist_group(group))


@pytest.hookimpl(tryfirst=True)  # before xdist's, which reads the groups into the node ids
def pytest_collection_modifyitems(config, items):
    """Without torch, the torch_reference tests are skipped; off the 3.11 stack, ONE_STACK's (pytest's
    closing line counts both). A module's tests that share its module-scoped fixtures run on one worker."""
    group_modules_by_their_fixtures(items)
    for item in items:
        if not HAS_TORCH_REFERENCE and item.get_closest_marker("torch_reference"):
            item.add_marker(WITHOUT_TORCH)
        why = one_stack_reason(item.nodeid)
        if why and not FIRST_STACK:
            item.add_marker(pytest.mark.skip(reason=f"runs on the Python 3.11 stack only: {why}"))
