"""The one logical-axis rules table: logical names -> mesh axes.

Parameters, optimizer state, activations at block boundaries and the batch all take their
shardings from here. Changing the parallelism strategy is a mesh-shape change: axes of size 1
drop out of every spec.
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

RULES: dict[str, tuple[str, ...]] = {
    # activations
    "batch": ("data", "fsdp", "expert"),
    "seq": ("context",),
    # parameters
    "embed": ("fsdp",),
    "vocab": ("tensor",),
    "q_heads": ("tensor",),
    "kv_heads": ("tensor",),
    "value_heads": (),  # K/2 heads per value projection (1 in ZAYA1): replicated
    "qk_heads": ("tensor",),
    "head_dim": (),
    "experts": ("expert",),
    "expert_mlp": ("tensor",),
    "router": (),
    "router_classes": (),
    "layers": (),
}


def mesh_axes_for(logical: str | None, mesh_shape: dict[str, int], used: set[str]) -> tuple[str, ...]:
    if logical is None:
        return ()
    if logical not in RULES:
        raise ValueError(f"logical axis {logical!r} has no rule in zaya_jax.parallel.rules.RULES")
    return tuple(a for a in RULES[logical] if mesh_shape.get(a, 1) > 1 and a not in used)


def logical_to_spec(logical: Sequence[str | None], shape: Sequence[int], mesh_shape: dict[str, int],
                    where: str) -> P:
    """Logical names of each dim -> PartitionSpec, checking that each dim divides its mesh axes."""
    used: set[str] = set()
    spec = []
    for dim, (name, size) in enumerate(zip(logical, shape)):
        axes = mesh_axes_for(name, mesh_shape, used)
        n = math.prod(mesh_shape[a] for a in axes)
        if size % n:
            raise ValueError(f"{where}: dimension {dim} ({name}, size {size}) is not divisible by mesh axis "
                             f"{'x'.join(axes)} of size {n}")
        used.update(axes)
        spec.append(axes[0] if len(axes) == 1 else (axes or None))
    return P(*spec)


def _mesh_shape(mesh: Mesh | dict[str, int]) -> dict[str, int]:
    return dict(mesh) if isinstance(mesh, dict) else dict(mesh.shape)


def state_specs(state: nnx.State, mesh: Mesh | dict[str, int]) -> nnx.State:
    """PartitionSpecs for every leaf of an (abstract) model state, from its logical axes.

    `mesh` may be a Mesh or just its shape {axis: size} (planning for meshes not present here).
    """
    shape = _mesh_shape(mesh)

    def one(path, var):
        names = var.get_metadata().get("out_sharding") or (None,) * len(var.shape)
        return var.replace(logical_to_spec(names, var.shape, shape, "/".join(map(str, path))))
    return nnx.map_state(one, state)


def state_shardings(state: nnx.State, mesh: Mesh) -> nnx.State:
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), state_specs(state, mesh),
                        is_leaf=lambda x: isinstance(x, P))


def with_data_axis(spec: P, shape: Sequence[int], mesh: Mesh | dict[str, int]) -> P:
    """Adds 'data' to the first dimension it divides (optimizer-state sharding over data, ZeRO-1)."""
    size = _mesh_shape(mesh).get("data", 1)
    entries = list(spec) + [None] * (len(shape) - len(spec))
    if size == 1 or any("data" in ((e,) if isinstance(e, str) else (e or ())) for e in entries):
        return spec
    for dim, entry in enumerate(entries):
        axes = (entry,) if isinstance(entry, str) else tuple(entry or ())
        n = math.prod(_mesh_shape(mesh)[a] for a in axes)
        if shape[dim] % (n * size) == 0:
            entries[dim] = axes + ("data",) if axes else "data"
            return P(*entries)
    return spec


def batch_spec(mesh: Mesh, ndim: int = 2) -> P:
    """[batch, seq, ...] arrays: batch over data/fsdp/expert, seq over context."""
    shape = _mesh_shape(mesh)
    batch = tuple(a for a in RULES["batch"] if shape.get(a, 1) > 1)
    seq = tuple(a for a in RULES["seq"] if shape.get(a, 1) > 1)
    spec = [batch if len(batch) > 1 else (batch[0] if batch else None), seq[0] if seq else None]
    return P(*spec, *([None] * (ndim - 2)))
