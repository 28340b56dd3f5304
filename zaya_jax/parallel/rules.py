"""The one logical-axis rules table: logical names -> mesh axes.

Parameters, optimizer state, activations at block boundaries and the batch all take their
shardings from here. Changing the parallelism strategy is a mesh-shape change: axes of size 1
drop out of every spec.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from zaya_jax.config import ConfigError

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
    # the vision tower (zaya_jax.model.vision.tower): width like embed, heads and MLP like the text model's
    "vision_embed": ("fsdp",),
    "vision_heads": ("tensor",),
    "vision_mlp": ("tensor",),
    "patch": (),
}


def mesh_axes_for(logical: str | None, mesh_shape: dict[str, int], used: set[str]) -> tuple[str, ...]:
    if logical is None:
        return ()
    if logical not in RULES:
        raise ValueError(f"logical axis {logical!r} has no rule in zaya_jax.parallel.rules.RULES")
    return tuple(a for a in RULES[logical] if mesh_shape.get(a, 1) > 1 and a not in used)


def sharded_dims(logical: Sequence[str | None], shape: Sequence[int], mesh_shape: dict[str, int]):
    """(dim, logical name, size, mesh axes) of each dimension of an array: the axes of size > 1 its rule
    puts it on (a mesh axis shards one dimension of an array: the first that names it)."""
    used: set[str] = set()
    for dim, (name, size) in enumerate(zip(logical, shape)):
        axes = mesh_axes_for(name, mesh_shape, used)
        used.update(axes)
        yield dim, name, size, axes


def logical_to_spec(logical: Sequence[str | None], shape: Sequence[int], mesh_shape: dict[str, int],
                    where: str) -> P:
    """Logical names of each dim -> PartitionSpec, checking that each dim divides its mesh axes."""
    spec = []
    for dim, name, size, axes in sharded_dims(logical, shape, mesh_shape):
        n = math.prod(mesh_shape[a] for a in axes)
        if size % n:
            raise ValueError(f"{where}: dimension {dim} ({name}, size {size}) is not divisible by mesh axis "
                             f"{'x'.join(axes)} of size {n}")
        spec.append(axes[0] if len(axes) == 1 else (axes or None))
    return P(*spec)


def _logical_names(var) -> tuple:
    return var.get_metadata().get("out_sharding") or (None,) * len(var.shape)


def check_axes_divide(states: Sequence[nnx.State], mesh_shape: dict[str, int], where: str,
                      fix: Callable[[str, int], str]) -> None:
    """Every mesh axis must divide each parameter dimension the rules shard over it (each parameter rule
    names one axis). Otherwise a ConfigError (before anything is built): `where` (how the mesh was
    given), the axis and the first dimension it does not divide, every dimension that axis shards
    and the sizes of it that divide them all, and `fix(axis, the largest such size below the given one)`."""
    dims: dict[str, dict[str, tuple[int, str]]] = {}  # axis -> logical name -> (size, a parameter's path)
    for state in states:
        for path, var in nnx.to_flat_state(state):
            for _, name, size, axes in sharded_dims(_logical_names(var), var.shape, mesh_shape):
                for axis in axes:
                    dims.setdefault(axis, {}).setdefault(f"{name} = {size}", (size, "/".join(map(str, path))))
    for axis, named in dims.items():
        n = mesh_shape[axis]
        bad = next(((label, size, path) for label, (size, path) in named.items() if size % n), None)
        if bad is None:
            continue
        label, _, path = bad
        common = math.gcd(*(size for size, _ in named.values()))
        fitting = [d for d in range(1, common + 1) if common % d == 0]
        raise ConfigError(f"{where}: {axis}={n} does not divide {label} ({path}); the {axis} axis shards "
                          f"{', '.join(named)}, so {axis} must be {', '.join(map(str, fitting[:-1]))} or {fitting[-1]}"
                          f"\nfix: {fix(axis, max(d for d in fitting if d < n))}")


def _mesh_shape(mesh: Mesh | dict[str, int]) -> dict[str, int]:
    return dict(mesh) if isinstance(mesh, dict) else dict(mesh.shape)


def state_specs(state: nnx.State, mesh: Mesh | dict[str, int]) -> nnx.State:
    """PartitionSpecs for every leaf of an (abstract) model state, from its logical axes.

    `mesh` may be a Mesh or just its shape {axis: size} (planning for meshes not present here).
    """
    shape = _mesh_shape(mesh)

    def one(path, var):
        return var.replace(logical_to_spec(_logical_names(var), var.shape, shape, "/".join(map(str, path))))
    return nnx.map_state(one, state)


def state_shardings(state: nnx.State, mesh: Mesh) -> nnx.State:
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), state_specs(state, mesh),
                        is_leaf=lambda x: isinstance(x, P))


# ZeRO-1's group: the axes over which every weight is replicated while the tokens are split, so
# its gradient is summed over all of them (Megatron-Core's distributed optimizer over DP x CP).
# `expert` splits tokens too but not the experts' own weights, so it stays out.
ZERO1_AXES = ("data", "context")


def zero1_axes(mesh: Mesh | dict[str, int]) -> tuple[str, ...]:
    """The ZERO1_AXES of size > 1, in device order (data major)."""
    shape = _mesh_shape(mesh)
    return tuple(a for a in ZERO1_AXES if shape.get(a, 1) > 1)


def with_zero1_axes(spec: P, shape: Sequence[int], mesh: Mesh | dict[str, int]) -> P:
    """Adds the ZeRO-1 axes (zero1_axes: data, then context) to the first dimension they divide
    together with the axes already there (optimizer-state sharding over the data-parallel group,
    ZeRO-1); `spec` unchanged where one of them is already used or no dimension divides."""
    sizes = _mesh_shape(mesh)
    added = zero1_axes(sizes)
    entries = list(spec) + [None] * (len(shape) - len(spec))
    used = {a for e in entries for a in ((e,) if isinstance(e, str) else (e or ()))}
    if not added or used & set(added):
        return spec
    for dim, entry in enumerate(entries):
        axes = (entry,) if isinstance(entry, str) else tuple(entry or ())
        n = math.prod(sizes[a] for a in axes + added)
        if shape[dim] % n == 0:
            joined = axes + added
            entries[dim] = joined[0] if len(joined) == 1 else joined
            return P(*entries)
    return spec


def batch_spec(mesh: Mesh, ndim: int = 2) -> P:
    """[batch, seq, ...] arrays: batch over data/fsdp/expert, seq over context."""
    shape = _mesh_shape(mesh)
    batch = tuple(a for a in RULES["batch"] if shape.get(a, 1) > 1)
    seq = tuple(a for a in RULES["seq"] if shape.get(a, 1) > 1)
    spec = [batch if len(batch) > 1 else (batch[0] if batch else None), seq[0] if seq else None]
    return P(*spec, *([None] * (ndim - 2)))


def to_shardings(specs: Any, mesh: Mesh) -> Any:
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def with_shardings(abstract: Any, shardings: Any) -> Any:
    """ShapeDtypeStructs carrying `shardings` (restore targets)."""
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
