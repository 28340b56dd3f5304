"""The device mesh, from config.

Axes (always all five, in this order): data, fsdp, expert, tensor, context. A config gives each
a size; one may be -1 (the rest of the devices). `--mesh data=128,fsdp=8` style strings parse
to the same mapping. `check_platform_support` rejects a layout that needs a collective the
platform lacks (ragged_all_to_all on XLA:CPU), before anything compiles. `check_declared_platform`
stops a run whose config declares a platform (`mesh.platform`) that jax is not running on: a
GPU job on a machine whose jax has no GPU plugin would otherwise train on the CPU without a word.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from pallas_kernels._backend import GPU_TARGETS, target
from zaya_jax.config import ConfigError
from zaya_jax.errors import UserError
from zaya_jax.model.kernels import platform

MESH_AXES = ("data", "fsdp", "expert", "tensor", "context")
PLATFORMS = ("any", "cpu", "gpu", "cuda", "rocm", "tpu")  # mesh.platform: "gpu" is cuda or rocm
INSTALL = {"gpu": "pip install -e '.[cuda]' (NVIDIA, CUDA 12; '.[cuda13]' for CUDA 13) or pip install -e '.[rocm]' "
                  "(AMD, ROCm 7)",
           "cuda": "pip install -e '.[cuda]' (CUDA 12; '.[cuda13]' for CUDA 13)", "rocm": "pip install -e '.[rocm]' (on the node's ROCm 7)",
           "tpu": "pip install 'jax[tpu]'", "cpu": "JAX_PLATFORMS=cpu in the environment"}
CONFIG_FLAG = "--config.mesh."  # how the trainer's CLI sets one axis: CONFIG_FLAG + "data=-1"
MESH_FLAG = "--mesh "           # how a CLI whose --mesh takes AXIS=SIZE,... does (serve, planner, parallel.check)
RAGGED_ALL_TO_ALL_PLATFORMS = ("gpu", "tpu")  # XLA:CPU: "UNIMPLEMENTED: HLO opcode 'ragged-all-to-all'"


def parse_mesh_flag(text: str) -> dict[str, int]:
    """'data=2,fsdp=4' -> {'data': 2, 'fsdp': 4}."""
    sizes = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        if not sep or name not in MESH_AXES:
            raise ConfigError(f"--mesh: {part!r} is not AXIS=SIZE with AXIS in {MESH_AXES}")
        try:
            sizes[name] = int(value)
        except ValueError:
            raise ConfigError(f"--mesh: size of {name!r} must be an integer, got {value!r}") from None
    return sizes


def resolve_mesh_shape(sizes: Mapping[str, int], num_devices: int, flag: str = CONFIG_FLAG) -> dict[str, int]:
    """Fills defaults (1) and the one -1 axis; checks the product is the device count. An error
    writes an axis's setting as the caller's CLI takes it: `flag` + "data=-1" (CONFIG_FLAG, the
    trainer's; MESH_FLAG for a CLI whose --mesh takes AXIS=SIZE,...)."""
    unknown = sorted(set(sizes) - set(MESH_AXES))
    if unknown:
        raise ConfigError(f"{flag}{unknown[0]}: unknown mesh axis (axes: {MESH_AXES})")
    shape = {axis: int(sizes.get(axis, 1)) for axis in MESH_AXES}
    free = [a for a, n in shape.items() if n == -1]
    for axis, n in shape.items():
        if n == 0 or n < -1:
            raise ConfigError(f"{flag}{axis}={n}: sizes must be positive (or -1 for the rest of the devices)")
    if len(free) > 1:
        raise ConfigError(f"mesh: only one axis may be -1, got {free}")
    fixed = math.prod(n for n in shape.values() if n != -1)
    if free:
        if num_devices % fixed:
            raise ConfigError(f"mesh: {flag}{free[0]}=-1 cannot fill {num_devices} devices with the other axes' "
                              f"product {fixed}: choose axis sizes that divide {num_devices}")
        shape[free[0]] = num_devices // fixed
    if math.prod(shape.values()) != num_devices:
        described = ", ".join(f"{a}={n}" for a, n in shape.items() if n != 1) or "all 1"
        raise ConfigError(f"mesh: product of mesh axes ({described}) = {math.prod(shape.values())} "
                          f"!= {num_devices} devices: make the sizes multiply to {num_devices}, or set one "
                          f"axis to -1 (e.g. {flag}data=-1)")
    return shape


def phase_mesh_sizes(config, phase) -> dict[str, int]:
    """{axis: size} (one may be -1) of the mesh that curriculum `phase` (a PhaseInfo) runs on.

    One mesh serves every phase (docs/parallel.md says why): the config's mesh section. Callers
    that plan or check a phase (the launch test, the planner) ask here, so a per-phase mesh would
    change this one function.
    """
    del phase
    section = config.get("mesh", {})
    return {axis: int(section.get(axis, 1 if axis != "data" else -1)) for axis in MESH_AXES}


def check_platform_support(mesh_shape: Mapping[str, int], expert_parallel: str,
                           target_platform: str | None = None) -> None:
    """A layout needing a collective that the platform (default: this process's) lacks fails here."""
    target = target_platform or platform()
    if (expert_parallel == "ragged_all_to_all" and mesh_shape.get("expert", 1) > 1
            and target not in RAGGED_ALL_TO_ALL_PLATFORMS):
        raise ConfigError(f"model.expert_parallel='ragged_all_to_all' with mesh.expert={mesh_shape['expert']} needs "
                          f"jax.lax.ragged_all_to_all, which platform {target!r} cannot run (it runs on "
                          f"{' and '.join(RAGGED_ALL_TO_ALL_PLATFORMS)}); use model.expert_parallel=all_to_all "
                         "(fixed capacity) or model.expert_parallel=all_gather (dropless)")


class PlatformMismatchError(UserError):
    """The config declares a platform that this process's jax does not run on."""


def check_declared_platform(declared: str) -> None:
    """`declared` ("any" or one of PLATFORMS) against the platform jax runs on."""
    actual = target()
    if declared in ("any", actual) or (declared == "gpu" and actual in GPU_TARGETS):
        return
    kind = jax.devices()[0].device_kind
    raise PlatformMismatchError(f"mesh.platform={declared!r} but jax runs on {actual} ({kind}); "
                                f"fix: {INSTALL[declared]}, or set mesh.platform=any")


def make_mesh(sizes: Mapping[str, int], devices: Sequence[jax.Device] | None = None,
              flag: str = CONFIG_FLAG) -> Mesh:
    """A Mesh over `devices` (default: all) with Auto axis types (GSPMD-style sharding); errors name
    the axes as `flag` + "AXIS=SIZE" (resolve_mesh_shape)."""
    devices = list(jax.devices() if devices is None else devices)
    shape = resolve_mesh_shape(sizes, len(devices), flag)
    grid = np.asarray(devices, dtype=object).reshape([shape[a] for a in MESH_AXES])
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))
