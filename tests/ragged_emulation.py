"""jax.lax.ragged_all_to_all's documented semantics from collectives XLA:CPU runs (tests only).

XLA:CPU cannot run ragged_all_to_all, so the CPU tests inject this into the ragged exchange.
Per the jax docstring: with K slices per device and P devices, a sender's slice k goes to
device k // (K / P); the receiver writes it at all_to_all(output_offsets)[q] with length
recv_sizes[q], where q indexes (source, slice) source-major. Here every device all-gathers
every operand and every slice table and copies the rows addressed to it (autodiff goes through
the all_gather and the row gathers).
"""

import jax
import jax.numpy as jnp


def ragged_all_to_all_by_all_gather(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                                    axis_name):
    """operand [N, ...], output [M, ...], the four int [K] tables -> output [M, ...] with received rows."""
    del send_sizes  # equal to the receivers' recv_sizes by ragged_all_to_all's contract
    operands = jax.lax.all_gather(operand, axis_name)                                  # [P, N, ...]
    tables = jax.lax.all_gather(jnp.stack([input_offsets, output_offsets]), axis_name)  # [P, 2, K]
    devices, _, k = tables.shape
    per = k // devices
    mine = jax.lax.dynamic_slice_in_dim(tables, jax.lax.axis_index(axis_name) * per, per, axis=2)
    start, dest = mine[:, 0].reshape(-1), mine[:, 1].reshape(-1)                       # [K] source-major
    source = jnp.arange(k) // per
    rows = jnp.arange(output.shape[0])
    hit = (rows >= dest[:, None]) & (rows < (dest + recv_sizes)[:, None])               # [K, M]
    q = jnp.argmax(hit, axis=0)                                                         # [M] slice of each row
    value = operands[source[q], start[q] + rows - dest[q]]
    filled = hit.any(axis=0).reshape((-1,) + (1,) * (output.ndim - 1))
    return jnp.where(filled, value, output)
