"""Attention kernels on a mesh: each device runs the kernel on its own batch rows and heads.

A Pallas (Triton) kernel is an opaque custom call to XLA's partitioner: called on sharded
arrays outside `jax.shard_map`, it would be run on the gathered global q, k, v on every device.
So on a mesh the kernel runs inside `jax.shard_map`, like the MoE dispatch
(zaya_jax.parallel.moe_sharding):
  q [B,S,N,H], k, v [B,S,K,H]   batch over data/fsdp/expert, heads over tensor
  segment_ids [B,S]             batch over data/fsdp/expert
Query head n reads KV head n // (N/K); splitting both head axes over `tensor` in contiguous
blocks keeps every query head with its KV head on one device (K must divide by tensor, which
the parameter sharding already requires).

The kernel has no context-parallel (ring) exchange: with mesh.context > 1 the keys a query needs
live on other devices, so `check_attention_layout` refuses that layout before anything compiles.
"""

from __future__ import annotations

import functools
from typing import Callable, Mapping

import jax
from jax.sharding import PartitionSpec as P

from zaya_jax.errors import UserError
from zaya_jax.parallel.context import active_axes, current_mesh, current_mesh_shape
from zaya_jax.parallel.rules import RULES


class KernelLayoutError(UserError):
    """A mesh layout that a chosen kernel cannot run."""


def check_attention_layout(kernel: str, mesh_shape: Mapping[str, int]) -> None:
    """`kernel` is the resolved attention kernel ("xla" | "pallas")."""
    context = mesh_shape.get("context", 1)
    if kernel == "pallas" and context > 1:
        raise KernelLayoutError(
            f"model.attention_kernel='pallas' with mesh.context={context}: the Pallas flash attention has no "
            "context-parallel exchange; use model.attention_kernel=xla, or mesh.context=1 (e.g. mesh.tensor=2)")


def attention_on_mesh(attention: Callable, q: jax.Array, k: jax.Array, v: jax.Array,
                      segment_ids: jax.Array | None, window: int | None = None) -> jax.Array:
    """attention(q [b,S,n,H], k, v [b,S,k,H], segment_ids [b,S] | None, window) -> [b,S,n,H], run
    per device on the active mesh (as is without one) -> [B,S,N,H]."""
    attention = functools.partial(attention, window=window)
    shape = current_mesh_shape()
    if not any(n > 1 for n in shape.values()):
        return attention(q, k, v, segment_ids)
    check_attention_layout("pallas", shape)
    batch = active_axes(RULES["batch"], shape) or None
    tensor = "tensor" if shape.get("tensor", 1) > 1 else None
    heads = P(batch, None, tensor, None)
    if segment_ids is None:
        return jax.shard_map(lambda q, k, v: attention(q, k, v, None), mesh=current_mesh(),
                             in_specs=(heads, heads, heads), out_specs=heads, check_vma=False)(q, k, v)
    return jax.shard_map(attention, mesh=current_mesh(), in_specs=(heads, heads, heads, P(batch, None)),
                         out_specs=heads, check_vma=False)(q, k, v, segment_ids)
