"""MoE dispatch on a mesh: tokens stay on their device; experts may be split over devices.

Inside `jax.shard_map` each device routes its own tokens (batch over data/fsdp/expert, seq over
context), so sorting never gathers the global batch. Expert weights arrive as their shards:
  tensor > 1   each device holds a slice of every expert's hidden size; partial outputs psum.
  expert > 1   each device holds E / expert experts, and `expert_parallel` picks how tokens
               meet them:
                 all_to_all  tokens are bucketed per expert with a fixed capacity and exchanged
                             with all_to_all there and back (overflow is dropped and counted);
                 all_gather  dropless: the expert group's tokens are all-gathered, each device
                             runs its own experts with the local backend, outputs are
                             reduce-scattered back (more traffic, no drops).
                 ragged_all_to_all  dropless: only the routed tokens travel, with
                             jax.lax.ragged_all_to_all there and back (GPU/TPU; XLA:CPU cannot
                             run it; zaya_jax.parallel.ragged_exchange).
Without a mesh (or with every axis 1) the local dispatch runs as is.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from zaya_jax.model.moe_dispatch import ExpertWeights, capacity_per_expert, sort_by_expert, unsort
from zaya_jax.parallel.context import active_axes, current_mesh, current_mesh_shape
from zaya_jax.parallel.mesh import check_platform_support
from zaya_jax.parallel.ragged_exchange import expert_parallel_ragged
from zaya_jax.parallel.rules import RULES


def expert_parallel_capacity(x: jax.Array, expert: jax.Array, w: ExpertWeights, *, axis: str, num_experts: int,
                             capacity_factor: float) -> tuple[jax.Array, jax.Array]:
    """Local x [T,D], expert [T] in [0,E]; w holds this device's E/ep experts -> (y [T,D], dropped)."""
    (t, d), local_experts = x.shape, w.gate.shape[0]
    ep = num_experts // local_experts
    cap = capacity_per_expert(t, num_experts, capacity_factor)
    s = sort_by_expert(expert, num_experts)
    routed = s.expert < num_experts
    keep = routed & (s.rank < cap)
    slot = jnp.where(keep, s.expert * cap + s.rank, num_experts * cap)
    buckets = jnp.zeros((num_experts * cap + 1, d), x.dtype).at[slot].set(x[s.order])[:-1]
    # [E*C, D] -> all_to_all: device k receives every device's buckets for its experts.
    received = jax.lax.all_to_all(buckets.reshape(num_experts, cap, d), axis, 0, 0, tiled=True)
    received = received.reshape(ep, local_experts, cap, d).transpose(1, 0, 2, 3).reshape(local_experts, ep * cap, d)
    hidden = jax.nn.silu(jnp.einsum("ecd,edi->eci", received, w.gate)) * jnp.einsum("ecd,edi->eci", received, w.up)
    out = jnp.einsum("eci,eid->ecd", hidden, w.down)
    out = out.reshape(local_experts, ep, cap, d).transpose(1, 0, 2, 3).reshape(num_experts, cap, d)
    out = jax.lax.all_to_all(out, axis, 0, 0, tiled=True).reshape(num_experts * cap, d)
    out = jnp.concatenate([out, jnp.zeros((1, d), x.dtype)])
    return unsort(out[slot], s.order), jnp.sum(routed & ~keep).astype(jnp.int32)


def expert_parallel_gather(x: jax.Array, expert: jax.Array, w: ExpertWeights, *, axis: str, dispatch: Callable
                           ) -> tuple[jax.Array, jax.Array]:
    """Local x [T,D], expert [T]; w holds this device's experts -> (y [T,D], dropped by `dispatch`)."""
    local_experts = w.gate.shape[0]
    x_all = jax.lax.all_gather(x, axis, tiled=True)                       # [ep*T, D]
    local = jax.lax.all_gather(expert, axis, tiled=True) - jax.lax.axis_index(axis) * local_experts
    mine = (local >= 0) & (local < local_experts)
    y_all, dropped = dispatch(x_all, jnp.where(mine, local, local_experts), w)  # others: local "skip"
    return jax.lax.psum_scatter(y_all, axis, scatter_dimension=0, tiled=True), dropped


def dispatch_on_mesh(dispatch: Callable, x: jax.Array, expert: jax.Array, w: ExpertWeights, *,
                     capacity_factor: float, expert_parallel: str = "all_to_all",
                     exchange: Callable | None = None) -> tuple[jax.Array, jax.Array]:
    """x: [B,S,D], expert: [B,S] -> (y [B,S,D], dropped []) with `dispatch` on each device's tokens.

    `exchange` (ragged_all_to_all's signature) serves `expert_parallel="ragged_all_to_all"`; None
    means jax.lax.ragged_all_to_all, after checking that this platform has it (tests inject an
    emulation on CPU).
    """
    b, s, d = x.shape
    shape = current_mesh_shape()
    if not any(n > 1 for n in shape.values()):
        y, dropped = dispatch(x.reshape(b * s, d), expert.reshape(b * s), w)
        return y.reshape(b, s, d), dropped
    batch = active_axes(RULES["batch"], shape) or None
    seq = active_axes(RULES["seq"], shape) or None
    tensor = "tensor" if shape.get("tensor", 1) > 1 else None
    ep = "expert" if shape.get("expert", 1) > 1 else None
    num_experts = w.gate.shape[0]
    token_axes = tuple(batch or ()) + tuple(seq or ())
    if ep and expert_parallel == "ragged_all_to_all" and exchange is None:
        check_platform_support(shape, expert_parallel)
        exchange = jax.lax.ragged_all_to_all

    def local(x, expert, gate, up, down):
        lb, ls, _ = x.shape
        xf, ef, wl = x.reshape(lb * ls, d), expert.reshape(lb * ls), ExpertWeights(gate, up, down)
        if ep and expert_parallel == "all_gather":
            y, dropped = expert_parallel_gather(xf, ef, wl, axis=ep, dispatch=dispatch)  # own experts' drops
        elif ep and expert_parallel == "ragged_all_to_all":
            y, dropped = expert_parallel_ragged(xf, ef, wl, axis=ep, num_experts=num_experts, dispatch=dispatch,
                                                exchange=exchange)                    # own experts' drops
        elif ep:
            y, dropped = expert_parallel_capacity(xf, ef, wl, axis=ep, num_experts=num_experts,
                                                  capacity_factor=capacity_factor)
        else:
            y, dropped = dispatch(xf, ef, wl)
        if tensor:
            y = jax.lax.psum(y, tensor)
        if token_axes:
            dropped = jax.lax.psum(dropped, token_axes)
        return y.reshape(lb, ls, d), dropped

    tokens = P(batch, seq, None)
    return jax.shard_map(
        local, mesh=current_mesh(),
        in_specs=(tokens, P(batch, seq), P(ep, None, tensor), P(ep, None, tensor), P(ep, tensor, None)),
        out_specs=(tokens, P()), check_vma=False,
    )(x, expert, w.gate, w.up, w.down)
