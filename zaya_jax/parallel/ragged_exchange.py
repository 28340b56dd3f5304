"""Dropless expert parallelism with `jax.lax.ragged_all_to_all`: only routed tokens travel.

Runs inside `jax.shard_map` over the `expert` axis: ep devices, each holding L = E / ep experts
(device j owns experts [j*L, (j+1)*L)). Per device, with T local tokens:

  1. Sort the tokens by expert. The rows bound for device j are one contiguous run of the
     sorted buffer: input_offsets[j], send_sizes[j]. Skip-slot tokens (expert E) stay home.
  2. counts[j, l] = my tokens for device j's expert l; all_to_all(counts) gives
     recv[i, l] = the rows source i sends me for my expert l, and recv_sizes[i] = sum_l recv[i, l].
  3. My receive buffer has the static dropless bound of ep*T rows (the whole group's tokens
     could pick my experts) and is filled source-major: source i's run lands at
     recv_offsets[i] = sum_{i' < i} recv_sizes[i']. ragged_all_to_all wants, from each sender,
     where its runs land on their receivers: output_offsets = all_to_all(recv_offsets).
  4. Within source i's run the rows are sorted by my local expert, so row r of the buffer
     belongs to local expert (segment of r in the flattened recv) mod L; unfilled rows get
     the local skip slot L. The local dispatch backend runs my experts on the buffer.
  5. The way back is the same exchange with the roles swapped: operand the expert outputs,
     input_offsets = recv_offsets, send_sizes = recv_sizes, output_offsets =
     all_to_all(input_offsets) (where each run started in its sender's sorted buffer),
     recv_sizes = send_sizes. Then unsort; skip-slot rows stay 0.

The exchange is a parameter with ragged_all_to_all's signature, so tests on XLA:CPU (which
cannot run ragged_all_to_all) inject an emulation; `zaya_jax.parallel.mesh.check_platform_support`
rejects this layout on such a platform before anything compiles.

Shapes: T local tokens, D hidden, E experts, L local experts, ep expert-axis size.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from zaya_jax.model.expert_windows import exclusive_cumsum
from zaya_jax.model.moe_dispatch import ExpertWeights, sort_by_expert, unsort


class ExchangePlan(NamedTuple):
    """Offsets and sizes of both trips, as ragged_all_to_all takes them (all int32 [ep] but row_expert)."""
    input_offsets: jax.Array   # start of my run for device j in my sorted buffer
    send_sizes: jax.Array      # rows of that run
    output_offsets: jax.Array  # where that run lands in device j's receive buffer
    recv_offsets: jax.Array    # where source i's run lands in my receive buffer
    recv_sizes: jax.Array      # rows source i sends me
    return_offsets: jax.Array  # where my outputs for source i land in its sorted buffer
    row_expert: jax.Array      # [ep*T] local expert of each receive-buffer row; L for unfilled rows


def exchange_plan(group_sizes: jax.Array, *, axis: str, local_experts: int, buffer_rows: int) -> ExchangePlan:
    """group_sizes [E]: my tokens per expert (runs of the sorted buffer) -> both trips' bookkeeping."""
    a2a = lambda v: jax.lax.all_to_all(v, axis, 0, 0, tiled=True)  # noqa: E731
    counts = group_sizes.reshape(-1, local_experts)                  # [ep, L]
    send_sizes = counts.sum(1)
    input_offsets = exclusive_cumsum(send_sizes)
    recv = a2a(counts)                                               # [ep, L]
    recv_sizes = recv.sum(1)
    recv_offsets = exclusive_cumsum(recv_sizes)
    run_ends = jnp.cumsum(recv.reshape(-1))                          # source-major, then local expert
    segment = jnp.searchsorted(run_ends, jnp.arange(buffer_rows, dtype=run_ends.dtype), side="right")
    row_expert = jnp.where(segment < run_ends.shape[0], segment % local_experts, local_experts)
    return ExchangePlan(input_offsets, send_sizes, a2a(recv_offsets), recv_offsets, recv_sizes,
                        a2a(input_offsets), row_expert.astype(jnp.int32))


def expert_parallel_ragged(x: jax.Array, expert: jax.Array, w: ExpertWeights, *, axis: str, num_experts: int,
                           dispatch: Callable, exchange: Callable = jax.lax.ragged_all_to_all
                           ) -> tuple[jax.Array, jax.Array]:
    """Local x [T,D], expert [T] in [0,E]; w holds this device's L experts -> (y [T,D], dropped by `dispatch`).

    `exchange(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name)`
    has jax.lax.ragged_all_to_all's semantics.
    """
    (t, d), local_experts = x.shape, w.gate.shape[0]
    buffer_rows = num_experts // local_experts * t
    s = sort_by_expert(expert, num_experts)
    p = exchange_plan(s.group_sizes[:num_experts], axis=axis, local_experts=local_experts, buffer_rows=buffer_rows)
    received = exchange(x[s.order], jnp.zeros((buffer_rows, d), x.dtype), p.input_offsets, p.send_sizes,
                        p.output_offsets, p.recv_sizes, axis_name=axis)            # [ep*T, D]
    out, dropped = dispatch(received, p.row_expert, w)
    returned = exchange(out, jnp.zeros((t, d), x.dtype), p.recv_offsets, p.recv_sizes, p.return_offsets,
                        p.send_sizes, axis_name=axis)                              # [T, D] sorted order
    return unsort(returned, s.order), dropped
