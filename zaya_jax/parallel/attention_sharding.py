"""Attention kernels on a mesh: each device runs the kernel on its own batch rows, heads and
query chunk.

A Pallas (Triton) kernel is an opaque custom call to XLA's partitioner: called on sharded
arrays outside `jax.shard_map`, it would be run on the gathered global q, k, v on every device.
So on a mesh the kernel runs inside `jax.shard_map`, like the MoE dispatch
(zaya_jax.parallel.moe_sharding):
  q [B,S,N,H], k, v [B,S,K,H]   batch over data/fsdp/expert, sequence over context, heads over tensor
  segment_ids [B,S]             batch over data/fsdp/expert, sequence over context
Query head n reads KV head n // (N/K); splitting both head axes over `tensor` in contiguous
blocks keeps every query head with its KV head on one device (K must divide by tensor, which
the parameter sharding already requires).

Context parallelism (mesh.context = C > 1) is the all-gather kind (Megatron-Core, Llama 3): the
sequence is cut into C contiguous chunks of s = S / C tokens as the model lays it out (the `seq`
rule, zaya_jax.parallel.rules; shard_map hands rank c the chunk [c*s, (c+1)*s)); every rank
gathers all ranks' keys, values and key segment ids ([b,S,k,H]: CCA's 2 KV heads make them
small) and runs the kernel on query chunks at their offsets (`cca_flash_attention`'s `q_offset`).
jax differentiates the all-gather into the reduce-scatter of dk and dv.
Load balance (zigzag): under causal attention the chunk at c costs about c + 1/2 chunks of keys,
so full causal layers cut the sequence into 2C halves of s/2 and rank c computes halves c and
2C-1-c (about 2C half-chunks of keys on every rank): it sends its own halves 2c, 2c+1 to the ranks
computing them (two ppermutes), calls the kernel once per received half, and permutes the
outputs back, so the rest of the model keeps its contiguous layout. That costs a permute of
half the local queries and outputs each way (and of dq, do in the backward). Sliding-window
layers (every chunk sees about as many keys) and chunks of odd length keep the contiguous chunk.
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from zaya_jax.parallel.context import active_axes, current_mesh, current_mesh_shape
from zaya_jax.parallel.rules import RULES


def zigzag_halves(rank, size: int):
    """The two sequence halves (of 2 * size) that context rank `rank` (an int or traced) computes
    in the zigzag layout: rank and 2 * size - 1 - rank."""
    return rank, 2 * size - 1 - rank


def _zigzag_owner(half: int, size: int) -> int:
    """The context rank that computes sequence half `half` (of 2 * size) in the zigzag layout."""
    return half if half < size else 2 * size - 1 - half


def _context_chunk(attention: Callable, axes: tuple[str, ...], size: int, zigzag: bool, q: jax.Array,
                   k: jax.Array, v: jax.Array, segment_ids: jax.Array | None) -> jax.Array:
    """Inside shard_map with the sequence over mesh `axes` (`size` ranks): q [b,s,n,H] at positions
    [c*s, (c+1)*s) of rank c along them, k, v [b,s,k,H] and segment_ids [b,s] | None of the same
    chunk -> [b,s,n,H], attending to the keys of every chunk. zigzag: rank c computes the
    sequence halves c and 2*size-1-c (of s/2 queries each) instead of its own two."""
    gather = functools.partial(lax.all_gather, axis_name=axes, axis=1, tiled=True)
    k, v = gather(k), gather(v)
    kv_segment_ids = None if segment_ids is None else gather(segment_ids)
    rank = lax.axis_index(axes)

    def run(queries, start):  # queries [b,Sq,n,H] at positions [start, start + Sq)
        seg = None if kv_segment_ids is None else lax.dynamic_slice_in_dim(kv_segment_ids, start, queries.shape[1], 1)
        return attention(queries, k, v, seg, kv_segment_ids=kv_segment_ids, q_offset=start)

    if not zigzag:
        return run(q, rank * q.shape[1])
    half = q.shape[1] // 2
    # rank c holds halves 2c and 2c+1; each permutation sends one of them to the rank computing it
    to_owner = [[(c, _zigzag_owner(2 * c + i, size)) for c in range(size)] for i in (0, 1)]
    even, odd = (lax.ppermute(x, axes, perm) for x, perm in zip((q[:, :half], q[:, half:]), to_owner))
    low_is_even = rank % 2 == 0  # of the halves c and 2*size-1-c (one even, one odd) received
    low, high = jnp.where(low_is_even, even, odd), jnp.where(low_is_even, odd, even)
    out_low, out_high = (run(x, i * half) for x, i in zip((low, high), zigzag_halves(rank, size)))
    outs = jnp.where(low_is_even, out_low, out_high), jnp.where(low_is_even, out_high, out_low)
    return jnp.concatenate([lax.ppermute(x, axes, [(o, c) for c, o in perm]) for x, perm in zip(outs, to_owner)],
                           axis=1)


def attention_on_mesh(attention: Callable, q: jax.Array, k: jax.Array, v: jax.Array,
                      segment_ids: jax.Array | None, window: int | None = None) -> jax.Array:
    """Runs attention per device on the active mesh (as is without one): q [B,S,N,H], k, v
    [B,S,K,H], segment_ids [B,S] | None -> [B,S,N,H].

    attention(q [b,Sq,n,H], k, v [b,Sk,k,H], segment_ids [b,Sq] | None, window=,
    kv_segment_ids=[b,Sk] | None, q_offset=int32 scalar) -> [b,Sq,n,H]; the last two only with
    mesh.context > 1 (the queries at [q_offset, q_offset + Sq) of the Sk keys)."""
    attention = functools.partial(attention, window=window)
    shape = current_mesh_shape()
    if not any(n > 1 for n in shape.values()):
        return attention(q, k, v, segment_ids)
    batch = active_axes(RULES["batch"], shape) or None
    seq = active_axes(RULES["seq"], shape)
    tensor = "tensor" if shape.get("tensor", 1) > 1 else None
    heads, rows = P(batch, seq or None, tensor, None), P(batch, seq or None)

    size = math.prod(shape[a] for a in seq)
    zigzag = window is None and q.shape[1] % (2 * size) == 0

    def local(q, k, v, segment_ids=None):
        if seq:
            return _context_chunk(attention, seq, size, zigzag, q, k, v, segment_ids)
        return attention(q, k, v, segment_ids)

    args, specs = (q, k, v), (heads, heads, heads)
    if segment_ids is not None:
        args, specs = args + (segment_ids,), specs + (rows,)
    return jax.shard_map(local, mesh=current_mesh(), in_specs=specs, out_specs=heads, check_vma=False)(*args)
