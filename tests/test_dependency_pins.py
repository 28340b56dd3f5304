"""pyproject.toml pins the tested stack on each Python branch, and the GPU extras pin the same jax.

Static checks of pyproject.toml (no network): for Python 3.11 and 3.12 alike, jax, jaxlib and flax
are pinned exactly, and every GPU extra (cuda, cuda13, rocm) pins jax, with one of jax's own
extras, at the core jax version. The running interpreter's installed jax, jaxlib and flax are the
ones its branch pins, and the installed jax provides every extra named.
"""

import importlib.metadata
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

PYPROJECT = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())
BRANCHES = ("3.11", "3.12")  # python_version < '3.12' (jax 0.10.2) and >= '3.12' (jax 0.11)
EXACT = ("jax", "jaxlib", "flax")
GPU_EXTRAS = ("cuda", "cuda13", "rocm")


def requirements(lines: list[str], python_version: str) -> list[Requirement]:
    """The requirements of `lines` whose marker holds on `python_version`."""
    reqs = [Requirement(line) for line in lines]
    return [r for r in reqs if r.marker is None or r.marker.evaluate({"python_version": python_version})]


def exact_version(reqs: list[Requirement], name: str) -> str:
    """The version `name` is pinned to by its one requirement in `reqs` ('==X', nothing else)."""
    ours = [r for r in reqs if r.name == name]
    assert len(ours) == 1, (name, [str(r) for r in ours])
    spec, = ours[0].specifier
    assert spec.operator == "==" and "*" not in spec.version, str(ours[0])
    return spec.version


def pins(python_version: str) -> dict[str, str]:
    core = requirements(PYPROJECT["project"]["dependencies"], python_version)
    return {name: exact_version(core, name) for name in EXACT}


@pytest.mark.parametrize("python_version", BRANCHES)
def test_core_stack_pinned_exactly(python_version):
    versions = pins(python_version)
    assert versions["jax"] == versions["jaxlib"], versions


@pytest.mark.parametrize("python_version", BRANCHES)
@pytest.mark.parametrize("extra", GPU_EXTRAS)
def test_gpu_extra_pins_the_core_jax(extra, python_version):
    reqs = requirements(PYPROJECT["project"]["optional-dependencies"][extra], python_version)
    assert exact_version(reqs, "jax") == pins(python_version)["jax"]
    jax_req, = reqs
    assert len(jax_req.extras) == 1, str(jax_req)


def test_installed_stack_is_the_pinned_one():
    branch = f"{sys.version_info.major}.{sys.version_info.minor}"
    assert {name: importlib.metadata.version(name) for name in EXACT} == pins(branch)
    provided = set(importlib.metadata.metadata("jax").get_all("Provides-Extra"))
    for extra in GPU_EXTRAS:
        for req in requirements(PYPROJECT["project"]["optional-dependencies"][extra], branch):
            assert req.extras <= provided, (extra, str(req), sorted(provided))
