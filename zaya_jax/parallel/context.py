"""The mesh of the current trace, if any (set by `jax.set_mesh`), in one guarded place.

Inside a jax.shard_map that is manual over some axes (zaya_jax.parallel.gradient_reduce: over
`data`), those axes are the enclosing map's: the shape leaves them out, so the model's own
shard_maps and sharding constraints split the local rows over the remaining axes alone."""

from __future__ import annotations

import jax


def current_mesh_shape() -> dict[str, int]:
    """{axis: size} of the active mesh's axes that are not manual; {} when there is none
    (single-device code paths)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return {}
    manual = set(mesh.manual_axes)
    return {axis: size for axis, size in mesh.shape.items() if axis not in manual}


def current_mesh():
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh.empty else mesh


def active_axes(names, shape: dict[str, int]) -> tuple[str, ...]:
    return tuple(a for a in names if shape.get(a, 1) > 1)
