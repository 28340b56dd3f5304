"""Sharding constraints on activations at block boundaries (no-ops without a mesh)."""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from zaya_jax.parallel.context import active_axes, current_mesh_shape
from zaya_jax.parallel.rules import RULES


def constrain_tokens(x: jax.Array) -> jax.Array:
    """x: [B, S, ...] -> same, constrained to batch over data/fsdp/expert and seq over context."""
    shape = current_mesh_shape()
    if not shape:
        return x
    batch = active_axes(RULES["batch"], shape)
    seq = active_axes(RULES["seq"], shape)
    spec = P(batch or None, seq or None, *([None] * (x.ndim - 2)))
    return jax.lax.with_sharding_constraint(x, spec)
