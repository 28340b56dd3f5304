"""The mesh of the current trace, if any (set by `jax.set_mesh`), in one guarded place."""

from __future__ import annotations

import jax


def current_mesh_shape() -> dict[str, int]:
    """{axis: size} of the active mesh; {} when there is none (single-device code paths)."""
    mesh = jax.sharding.get_abstract_mesh()
    return {} if mesh.empty else dict(mesh.shape)


def current_mesh():
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh.empty else mesh


def active_axes(names, shape: dict[str, int]) -> tuple[str, ...]:
    return tuple(a for a in names if shape.get(a, 1) > 1)
