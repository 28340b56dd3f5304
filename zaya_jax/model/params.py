"""Parameter creation with logical axis names.

Every parameter carries logical axis names (metadata key `out_sharding`, read back with
`nnx.get_partition_spec`); zaya_jax.parallel maps them to mesh axes with one rules table.
Eager sharding is off: a parameter is created unsharded and placed by whoever owns the mesh.

Logical names: vocab, embed, q_heads, kv_heads, value_heads (the K/2 heads of each CCA value
projection), head_dim, qk_heads (packed q|k heads of the CCA convolutions), experts, expert_mlp, router, router_classes, layers (added by stacking).
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx


class BalancingBias(nnx.Variable):
    """Router balancing biases: non-trainable state, updated outside autograd."""


def param(init: Callable, key: jax.Array, shape: Sequence[int], axes: Sequence[str | None]) -> nnx.Param:
    """A float32 master parameter initialised by `init(key, shape)` with logical `axes`."""
    if len(axes) != len(shape):
        raise ValueError(f"axes {axes} do not match shape {shape}")
    return nnx.Param(init(key, tuple(shape), jnp.float32), out_sharding=tuple(axes), eager_sharding=False)


def constant(value: float, shape: Sequence[int], axes: Sequence[str | None]) -> nnx.Param:
    """A float32 parameter filled with `value` (norm weights, residual scales, biases)."""
    return param(lambda _k, s, d: jnp.full(s, value, d), None, shape, axes)


def normal(std: float) -> Callable:
    return jax.nn.initializers.normal(std)
