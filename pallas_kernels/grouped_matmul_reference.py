"""Plain-JAX grouped matmuls: the specification of `grouped_matmul` and its weight gradient.

m rows, k contraction, n output columns, g groups (experts). Rows of lhs belong to groups in
order: group i owns rows [sum(group_sizes[:i]), sum(group_sizes[:i+1])); rows past
sum(group_sizes) belong to no group.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_HIGHEST = jax.lax.Precision.HIGHEST


def grouped_matmul_reference(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """lhs: [m, k], rhs: [g, k, n], group_sizes: [g] int32 -> [m, n]: row r times rhs[group(r)];
    rows in no group are zero. This is `jax.lax.ragged_dot` at full fp32 precision."""
    return jax.lax.ragged_dot(lhs, rhs, group_sizes, precision=_HIGHEST)


def group_membership(num_rows: int, group_sizes: jax.Array) -> jax.Array:
    """group_sizes: [g] -> bool [m, g]: row r belongs to group i."""
    ends = jnp.cumsum(group_sizes)
    rows = jnp.arange(num_rows)[:, None]
    return (rows >= ends - group_sizes) & (rows < ends)


def transposed_grouped_matmul_reference(lhs: jax.Array, grad: jax.Array,
                                        group_sizes: jax.Array) -> jax.Array:
    """lhs: [m, k], grad: [m, n], group_sizes: [g] -> [g, k, n]: lhs[rows of i]^T @ grad[rows of i]
    in fp32, cast to lhs.dtype (the gradient of ragged_dot with respect to rhs)."""
    member = group_membership(lhs.shape[0], group_sizes).astype(jnp.float32)
    out = jnp.einsum("mg,mk,mn->gkn", member, lhs.astype(jnp.float32), grad.astype(jnp.float32),
                     precision=_HIGHEST)
    return out.astype(lhs.dtype)
