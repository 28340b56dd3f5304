"""Data-parallel gradients summed over the `data` axis by hand, in a chosen dtype.

Left to XLA's partitioner (the default, mesh.gradient_reduce_dtype='float32'), a weight gradient
is reduced over `data` where its dot produces it: in float32 (the dots' accumulation type), once
per micro-batch. `summed_over_data` instead runs each data-parallel rank's rows through
`local` inside jax.shard_map, manual over `data` alone (fsdp, expert, tensor and context stay with
the partitioner and the model's own shard_maps, which leave the manual axis out:
zaya_jax.parallel.context), and then sums every gradient over `data` once, in `dtype` on the
wire, back to float32 after:

  rank d: grads_d = local(params, rows of rank d)              (float32, all micro-batches)
  grad    = reduce_scatter_data(grads_d.astype(dtype))         where the ZeRO-1 optimizer state
                                                                slices that dimension over data
                                                                (then context)
          | all_reduce_data(grads_d.astype(dtype))             otherwise
  extras  = all_reduce_data(extras_d)                          (loss sums, expert counts: exact)

That is what Megatron-Core's distributed optimizer does with grad_reduce_in_fp32=False: bf16
halves the bytes every rank sends, and M micro-batches send them once instead of M times; but
the sum runs after the whole backward instead of behind it (docs/parallel.md weighs the two).
The sum itself runs in the collective's arithmetic: bf16 adds on GPUs (NCCL/RCCL); XLA:CPU
widens a bf16 all-reduce to float32 and rounds once.

The reduction sits in a second, fully manual shard_map: XLA:CPU's all-reduce promotion pass
aborts on a bf16 all-reduce in a partly manual region (jax 0.10.2 and 0.11.2).

Meshes: `data` with at most one more axis of size > 1 (data alone, Zyphra's DP + ZeRO-1; data x
context, the shipped launch and the 32k phase; data x fsdp, expert or tensor). With two or more,
XLA's SPMD partitioner aborts partitioning the step's gathers inside the data-manual region
(spmd_partitioner_util.cc ExpandDeviceGroupsWithIota, jax 0.10.2 and 0.11.2): check_mesh refuses
those meshes before anything compiles.

summed_by_hand says when the step takes this path; the trainer, the planner's collective model
and its mesh search all ask it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from zaya_jax.config import ConfigError
from zaya_jax.parallel.context import current_mesh
from zaya_jax.parallel.rules import with_zero1_axes

GRADIENT_REDUCE_DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class GradientReduce:
    """How the train step sums gradients over `data` by hand: `dtype` on the wire; `param_specs`
    the parameters' PartitionSpecs; `zero1` whether the optimizer state is sharded over data (then
    a gradient is reduce-scattered into that slice where it can be)."""
    dtype: str
    param_specs: Any
    zero1: bool


ALL_REDUCE = -1


def summed_by_hand(mesh_shape: dict[str, int], dtype: str) -> bool:
    """Whether the train step sums the gradients over data by hand: mesh.gradient_reduce_dtype
    other than float32 on a mesh with data > 1 (else the partitioner reduces them)."""
    return dtype != "float32" and mesh_shape.get("data", 1) > 1


def unsupported_axes(mesh_shape: dict[str, int], dtype: str) -> list[str]:
    """['axis=n', ...]: the axes besides data that keep the hand-summed step from compiling (two or
    more of size > 1; module docstring); [] when it compiles or the partitioner reduces."""
    others = [f"{axis}={n}" for axis, n in mesh_shape.items() if axis != "data" and n > 1]
    return others if summed_by_hand(mesh_shape, dtype) and len(others) > 1 else []


def check_mesh(mesh_shape: dict[str, int], dtype: str) -> None:
    """Refuses (ConfigError) a mesh the hand-summed reduction cannot compile on."""
    others = unsupported_axes(mesh_shape, dtype)
    if others:
        raise ConfigError(f"mesh.gradient_reduce_dtype={dtype!r} runs on data with at most one other axis > 1, got "
                          f"data={mesh_shape['data']} with {', '.join(others)} (XLA's partitioner aborts on it): "
                          "set --config.mesh.gradient_reduce_dtype=float32 or fold an axis into data")


def scatter_dimension(spec: P, shape: tuple[int, ...], mesh: Mesh) -> int:
    """The dimension the ZeRO-1 optimizer state slices over `data` first (rules.with_zero1_axes:
    data alone, or data then context, which the partitioner slices further from the data slice),
    or ALL_REDUCE (that state keeps the gradient's layout, or puts data after other axes)."""
    sliced = with_zero1_axes(spec, shape, mesh)
    entries = list(spec) + [None] * (len(shape) - len(spec))
    for dim, (before, after) in enumerate(zip(entries, list(sliced) + [None] * (len(shape) - len(sliced)))):
        if before is None and (after == "data" or (isinstance(after, tuple) and after[0] == "data")):
            return dim
    return ALL_REDUCE


def _summed(grads, param_specs, dims, dtype):
    """Inside the data-manual region: each rank's gradients -> their sum over data in `dtype`
    (reduce-scattered along `dims` where not ALL_REDUCE), as float32."""
    mesh = current_mesh()
    rest = frozenset(mesh.axis_names) - frozenset(mesh.manual_axes)

    def one(g, dim):
        wire = g.astype(dtype)
        if dim == ALL_REDUCE:
            return jax.lax.psum(wire, "data").astype(jnp.float32)
        return jax.lax.psum_scatter(wire, "data", scatter_dimension=dim, tiled=True).astype(jnp.float32)

    def reduce(grads):
        return jax.tree.map(one, grads, dims)
    return jax.shard_map(reduce, mesh=mesh, in_specs=(param_specs,), out_specs=param_specs, axis_names=rest,
                         check_vma=False)(grads)


def summed_over_data(local: Callable, params, replicated, batch: dict, *, mesh: Mesh, reduce: GradientReduce):
    """local(params, replicated, rows {k: [B/data, ...]}) -> (grads like params, extras pytree)
    -> (grads summed over data, float32, in the ZeRO-1 slice where reduce-scattered; extras summed).

    params, replicated: whole on every data rank (other axes as the partitioner has them);
    batch {k: [B, ...]}: rows split over data in order (rank d holds rows [d*B/data, (d+1)*B/data))."""
    dtype = jnp.dtype(reduce.dtype)
    is_spec = lambda x: isinstance(x, P)  # noqa: E731
    dims = jax.tree.map(lambda spec, p: scatter_dimension(spec, p.shape, mesh) if reduce.zero1 else ALL_REDUCE,
                        reduce.param_specs, params, is_leaf=is_spec)
    out = jax.tree.map(lambda dim: P() if dim == ALL_REDUCE else P(*([None] * dim), "data"), dims)

    def rank(params, replicated, rows):
        grads, extras = local(params, replicated, rows)
        return (_summed(grads, reduce.param_specs, dims, dtype),
                jax.tree.map(lambda x: jax.lax.psum(x, "data"), extras))
    return jax.shard_map(rank, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=(out, P()),
                         axis_names={"data"}, check_vma=False)(params, replicated, batch)
