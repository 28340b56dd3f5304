"""MoE dispatch backends: how top-1-routed tokens reach their expert.

Every backend is a pure function
    backend(x [T,D], expert [T] int32 in [0,E], weights, **options) -> (y [T,D], dropped [] int32)
where y[t] = SwiGLU_{expert[t]}(x[t]) for a real expert and 0 for the skip slot (index E);
all backends compute the same function whenever nothing is dropped.

  dense     every expert on every token, masked. The reference.
  capacity  sort by expert into E fixed buckets of C = ceil(capacity_factor * T / E) rows,
            one batched einsum; overflow is dropped and counted.
  ragged    dropless: sort by expert, grouped matmul (jax.lax.ragged_dot or the Pallas kernel,
            which multiplies by the gate and up weights in one call).
  native    `ragged` with the native CPU grouped matmul (zaya_jax.native.grouped_matmul, chosen in
            zaya_jax.model.kernels): each expert's exact rows on BLAS.
  tiles     dropless in plain XLA: sort by expert, then a loop over the experts and over windows
            of `tile` rows of each expert's run (zaya_jax.model.expert_windows).

The expert matmul outputs of `capacity`, `ragged` and `native` carry the checkpoint names
EXPERT_OUTPUT_NAMES (gate, up, down), which the `dots_no_batch_and_kernels` remat policy saves:
neither a grouped matmul (ragged_dot, a Pallas or FFI kernel) nor a batched einsum is a dot
without batch dimensions, so `dots_no_batch` recomputes them in the backward pass.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from zaya_jax.model.expert_windows import exclusive_cumsum, expert_runs, expert_windows


class ExpertWeights(NamedTuple):
    gate: jax.Array  # [E, D, I]
    up: jax.Array    # [E, D, I]
    down: jax.Array  # [E, I, D]


EXPERT_OUTPUT_NAMES = ("expert_gate", "expert_up", "expert_down")


class SortedTokens(NamedTuple):
    order: jax.Array        # [T] token index at each sorted position
    expert: jax.Array       # [T] expert of each sorted position (ascending; skip = E last)
    rank: jax.Array         # [T] position of each sorted token within its expert's run
    group_sizes: jax.Array  # [E+1] tokens per expert, skip slot last


def sort_by_expert(expert: jax.Array, num_experts: int) -> SortedTokens:
    order = jnp.argsort(expert, stable=True)
    sorted_expert = expert[order]
    group_sizes = jnp.bincount(expert, length=num_experts + 1).astype(jnp.int32)
    starts = exclusive_cumsum(group_sizes)
    rank = jnp.arange(expert.shape[0], dtype=jnp.int32) - starts[sorted_expert]
    return SortedTokens(order, sorted_expert, rank, group_sizes)


def unsort(y_sorted: jax.Array, order: jax.Array) -> jax.Array:
    """Inverse of `x[order]`: [T, D] in sorted order -> token order."""
    return jnp.zeros_like(y_sorted).at[order].set(y_sorted, unique_indices=True)


def _swiglu(x, gate, up, down, spec: str):
    """Batched SwiGLU with einsum `spec` for the first matmuls, e.g. 'ecd,edi->eci'."""
    lhs, rhs_out = spec.split(",")
    rhs, out = rhs_out.split("->")
    down_spec = f"{out},{rhs[0]}{rhs[2]}{rhs[1]}->{lhs}"
    return _named_swiglu(lambda ws: tuple(jnp.einsum(spec, x, w) for w in ws),
                         lambda h: jnp.einsum(down_spec, h, down), gate, up)


def _named_swiglu(first: Callable, second: Callable, gate: jax.Array, up: jax.Array) -> jax.Array:
    """second(silu(g) * u) with (g, u) = first((gate, up)), each matmul output named
    (EXPERT_OUTPUT_NAMES)."""
    gate_name, up_name, down_name = EXPERT_OUTPUT_NAMES
    g, u = first((gate, up))
    hidden = jax.nn.silu(checkpoint_name(g, gate_name)) * checkpoint_name(u, up_name)
    return checkpoint_name(second(hidden), down_name)


def dense(x: jax.Array, expert: jax.Array, w: ExpertWeights) -> tuple[jax.Array, jax.Array]:
    num_experts = w.gate.shape[0]
    hidden = jax.nn.silu(jnp.einsum("td,edi->tei", x, w.gate)) * jnp.einsum("td,edi->tei", x, w.up)
    y_all = jnp.einsum("tei,eid->ted", hidden, w.down)
    return jnp.einsum("ted,te->td", y_all, jax.nn.one_hot(expert, num_experts, dtype=x.dtype)), jnp.int32(0)


def capacity_per_expert(num_tokens: int, num_experts: int, capacity_factor: float) -> int:
    return max(1, math.ceil(capacity_factor * num_tokens / num_experts))


def capacity(x: jax.Array, expert: jax.Array, w: ExpertWeights, *, capacity_factor: float
             ) -> tuple[jax.Array, jax.Array]:
    (t, d), num_experts = x.shape, w.gate.shape[0]
    cap = capacity_per_expert(t, num_experts, capacity_factor)
    s = sort_by_expert(expert, num_experts)
    routed = s.expert < num_experts
    keep = routed & (s.rank < cap)
    slot = jnp.where(keep, s.expert * cap + s.rank, num_experts * cap)
    buckets = jnp.zeros((num_experts * cap + 1, d), x.dtype).at[slot].set(x[s.order])
    out = _swiglu(buckets[:-1].reshape(num_experts, cap, d), w.gate, w.up, w.down, "ecd,edi->eci")
    out = jnp.concatenate([out.reshape(num_experts * cap, d), jnp.zeros((1, d), x.dtype)])
    dropped = jnp.sum(routed & ~keep).astype(jnp.int32)
    return unsort(out[slot], s.order), dropped


def ragged(x: jax.Array, expert: jax.Array, w: ExpertWeights, *,
           matmul: Callable = jax.lax.ragged_dot, matmuls: Callable | None = None,
           num_experts: int | None = None, first_group: int | jax.Array = 0) -> tuple[jax.Array, jax.Array]:
    """`matmul(lhs [T,K], rhs [G,K,N], group_sizes [G]) -> [T,N]` with ragged_dot semantics;
    `matmuls(lhs [T,K], (gate, up) each [G,K,N], group_sizes [G]) -> ([T,N], [T,N])` the gate and
    up products in one call (pallas_kernels.grouped_matmuls), None: `matmul` for each.

    w holds G groups: the E = num_experts experts (default G), or more, e.g. every layer's experts
    viewed as [L*E,K,N] (a free reshape of the stacked weights): expert e then multiplies group
    first_group + e and the other groups get no rows, so no layer's weights are sliced out."""
    groups = w.gate.shape[0]
    num_experts = groups if num_experts is None else num_experts
    s = sort_by_expert(expert, num_experts)
    sizes = s.group_sizes[:num_experts]
    if num_experts != groups:
        sizes = jax.lax.dynamic_update_slice(jnp.zeros((groups,), sizes.dtype), sizes, (first_group,))
    xs = x[s.order]
    if matmuls is None:
        def matmuls(lhs, ws, group_sizes):
            return tuple(matmul(lhs, wi, group_sizes) for wi in ws)
    y = _named_swiglu(lambda ws: matmuls(xs, ws, sizes), lambda h: matmul(h, w.down, sizes), w.gate, w.up)
    return unsort(y, s.order), jnp.int32(0)


def tiles(x: jax.Array, expert: jax.Array, w: ExpertWeights, *, tile: int) -> tuple[jax.Array, jax.Array]:
    (t, d), num_experts = x.shape, w.gate.shape[0]
    s = sort_by_expert(expert, num_experts)
    rows = jnp.concatenate([x[s.order], jnp.zeros((tile, d), x.dtype)])
    y = expert_windows(rows, w.gate, w.up, w.down, expert_runs(s.group_sizes[:num_experts]), tile)[:t]
    return unsort(jnp.where((s.expert < num_experts)[:, None], y, 0), s.order), jnp.int32(0)
