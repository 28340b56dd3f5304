"""Grouped matmul (MoE experts) as Pallas kernels: `jax.lax.ragged_dot` semantics, with custom_vjp.

m rows (tokens sorted by expert), k contraction, n output columns, g groups (experts); lhs rows
belong to groups consecutively, rows past sum(group_sizes) to none (their output is zero).

Kernels (Triton-style Pallas, no scalar prefetch, no atomics, so every program owns its output):
1. `gmm`, grid (m tile, n tile): before the pallas_call, plain JAX computes which groups each row
   tile touches (`_tile_groups`). A tile inside one group runs one k loop; a tile that straddles
   a boundary runs one k loop per group it touches, loading the rows of the other groups as zeros
   (masked loads, no select on the operand), and sums them in one fp32 accumulator. Empty groups
   skip their k loop. With p right-hand sides of one shape (`gmm_x2`: the MoE's gate and up
   weights) each lhs tile, loaded once per k step, feeds p accumulators and p outputs.
   Transposed-rhs mode (`lhs @ rhs[g].T`) gives the lhs gradient without copying rhs; with p
   pairs (`gmm_transposed_rhs_x2`) it sums lhs_i @ rhs_i[g].T, the pairs' k loops one after
   another into one accumulator (so one pair's shared memory).
2. `tgmm`, grid (group, k tile, n tile): out[g] = lhs[rows of g].T @ grad[rows of g], walking
   only the row tiles of group g, rows outside it loaded as zeros; an empty group writes zeros.
`grouped_matmuls`' custom_vjp (`grouped_matmul` is its p = 1 case) uses one transposed-rhs gmm for
d lhs (the sum over the p products) and one tgmm per right-hand side for d rhs: a tgmm sharing
its lhs tile between two grads would hold 240 KiB of shared memory at the cuda bf16 blocks
(pallas_kernels.platform_blocks), over the 227 KiB of an H100/H200.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import _backend
from pallas_kernels.platform_blocks import matmul_blocks

_NT = (((1,), (1,)), ((), ()))  # a @ b.T
_TN = (((0,), (0,)), ((), ()))  # a.T @ b


@dataclasses.dataclass(frozen=True)
class _Tiling:
    """Power-of-two tiles along m, k, n, with the platform's stages and warps (hashable: a
    custom_vjp nondiff argument)."""
    tm: int
    tk: int
    tn: int
    num_stages: int
    num_warps: int
    interpret: bool

    def options(self) -> dict:
        return _backend.pallas_call_options(self.interpret, num_warps=self.num_warps, num_stages=self.num_stages)


def _group_offsets(group_sizes: jax.Array, num_rows: int) -> jax.Array:
    """[g] -> [g + 1] int32: group i owns rows [offsets[i], offsets[i + 1]), cut at num_rows."""
    ends = jnp.minimum(jnp.cumsum(group_sizes.astype(jnp.int32)), num_rows)
    return jnp.concatenate([jnp.zeros((1,), jnp.int32), ends])


def _tile_groups(offsets: jax.Array, num_tiles: int, tm: int) -> tuple[jax.Array, jax.Array]:
    """offsets: [g + 1] -> first, stop: [num_tiles] int32; row tile t touches groups
    [first[t], stop[t]) (empty when the tile holds no grouped row)."""
    ends, total = offsets[1:], offsets[-1]
    starts = jnp.arange(num_tiles, dtype=jnp.int32) * tm
    last_rows = jnp.minimum(starts + tm, total) - 1
    first = jnp.searchsorted(ends, starts, side="right").astype(jnp.int32)
    last = jnp.searchsorted(ends, last_rows, side="right").astype(jnp.int32)
    return first, jnp.where(starts < total, last + 1, first)


def _gmm_kernel(offsets_ref, first_ref, stop_ref, *refs, tc: int, transpose_rhs: bool, count: int):
    """offsets_ref: [g + 1]; first_ref, stop_ref: [m tiles]; C is the contraction, tc its tile.
    Plain: refs = lhs [tm, C], rhs_1..rhs_count [g, C, to], out_1..out_count [tm, to]:
    out_i = lhs @ rhs_i[g], each lhs tile loaded once for all count products.
    transpose_rhs: refs = lhs_1..lhs_count [tm, C], rhs_1..rhs_count [g, to, C], out [tm, to]:
    out = sum_i lhs_i @ rhs_i[g].T, the pairs' k loops one after another."""
    lhs_refs = refs[:count if transpose_rhs else 1]
    rhs_refs = refs[len(lhs_refs):len(lhs_refs) + count]
    out_refs = refs[len(lhs_refs) + count:]
    t = pl.program_id(0)
    tm = out_refs[0].shape[0]
    rows = t * tm + jnp.arange(tm)
    num_c = lhs_refs[0].shape[1] // tc

    def group_body(group, accs):
        lo, hi = offsets_ref[group], offsets_ref[group + 1]
        member = jnp.broadcast_to(((rows >= lo) & (rows < hi))[:, None], (tm, tc))
        steps = jnp.where(hi > lo, num_c, 0)

        def load(lhs_ref, c):
            cols = pl.ds(pl.multiple_of(c * tc, tc), tc)
            return cols, plgpu.load(lhs_ref.at[:, cols], mask=member, other=0)

        if transpose_rhs:
            def pair_body(lhs_ref, rhs_ref):
                def c_body(c, acc):
                    cols, x = load(lhs_ref, c)
                    return acc + lax.dot_general(x, rhs_ref[group, :, cols], _NT, preferred_element_type=jnp.float32)
                return c_body
            (acc,) = accs
            for lhs_ref, rhs_ref in zip(lhs_refs, rhs_refs, strict=True):
                acc = lax.fori_loop(0, steps, pair_body(lhs_ref, rhs_ref), acc)
            return (acc,)

        def c_body(c, accs):
            cols, x = load(lhs_refs[0], c)
            return tuple(acc + jnp.dot(x, rhs_ref[group, cols, :], preferred_element_type=jnp.float32)
                         for acc, rhs_ref in zip(accs, rhs_refs, strict=True))
        return lax.fori_loop(0, steps, c_body, accs)

    accs = tuple(jnp.zeros(ref.shape, jnp.float32) for ref in out_refs)
    accs = lax.fori_loop(first_ref[t], stop_ref[t], group_body, accs)
    for ref, acc in zip(out_refs, accs, strict=True):
        ref[...] = acc.astype(ref.dtype)


def _gmm(lhs: tuple, rhs: tuple, offsets, tiling: _Tiling, *, transpose_rhs: bool) -> tuple:
    """Padded lhs: p (transpose_rhs) or 1 arrays [m, c]; rhs: p arrays [g, c, o] ([g, o, c] when
    transpose_rhs); offsets: [g + 1] -> 1 (transpose_rhs: the sum) or p arrays [m, o].
    Tiles: tm along m, tk along c, tn along o (both multiples of their tiles)."""
    (m, c), (groups, *rhs_dims), count = lhs[0].shape, rhs[0].shape, len(rhs)
    o = rhs_dims[0] if transpose_rhs else rhs_dims[1]
    tm, tc, to = tiling.tm, tiling.tk, tiling.tn
    num_tiles = m // tm
    first, stop = _tile_groups(offsets, num_tiles, tm)
    if transpose_rhs:
        rhs_spec = pl.BlockSpec((groups, to, c), lambda t, j: (0, j, 0))
    else:
        rhs_spec = pl.BlockSpec((groups, c, to), lambda t, j: (0, 0, j))
    num_out = 1 if transpose_rhs else count
    name = ("gmm_transposed_rhs" if transpose_rhs else "gmm") + ("" if count == 1 else f"_x{count}")
    return pl.pallas_call(
        functools.partial(_gmm_kernel, tc=tc, transpose_rhs=transpose_rhs, count=count),
        grid=(num_tiles, o // to),
        in_specs=[pl.BlockSpec((groups + 1,), lambda t, j: (0,)),
                  pl.BlockSpec((num_tiles,), lambda t, j: (0,)),
                  pl.BlockSpec((num_tiles,), lambda t, j: (0,)),
                  *[pl.BlockSpec((tm, c), lambda t, j: (t, 0))] * len(lhs),
                  *[rhs_spec] * count],
        out_specs=[pl.BlockSpec((tm, to), lambda t, j: (t, j))] * num_out,
        out_shape=[jax.ShapeDtypeStruct((m, o), lhs[0].dtype)] * num_out,
        name=name,
        **tiling.options(),
    )(offsets, first, stop, *lhs, *rhs)


def _tgmm_kernel(offsets_ref, lhs_ref, grad_ref, out_ref, *, tm: int):
    """lhs_ref: [m, tk]; grad_ref: [m, tn]; out_ref: [tk, tn]; offsets_ref: [g + 1]."""
    group = pl.program_id(0)
    lo, hi = offsets_ref[group], offsets_ref[group + 1]

    def body(t, acc):
        rows = pl.ds(pl.multiple_of(t * tm, tm), tm)
        pos = t * tm + jnp.arange(tm)
        member = jnp.broadcast_to(((pos >= lo) & (pos < hi))[:, None], (tm, lhs_ref.shape[1]))
        x = plgpu.load(lhs_ref.at[rows, :], mask=member, other=0)
        return acc + lax.dot_general(x, grad_ref[rows, :], _TN, preferred_element_type=jnp.float32)

    first = lax.div(lo, tm)
    stop = jnp.where(hi > lo, lax.div(hi + tm - 1, tm), first)
    acc = lax.fori_loop(first, stop, body, jnp.zeros(out_ref.shape, jnp.float32))
    out_ref[...] = acc.astype(out_ref.dtype)


def _tgmm(lhs, grad, offsets, tiling: _Tiling, out_dtype):
    """Padded lhs: [m, k], grad: [m, n], offsets: [g + 1] -> [g, k, n] in out_dtype."""
    (m, k), n, groups = lhs.shape, grad.shape[1], offsets.shape[0] - 1
    tm, tk, tn = tiling.tm, tiling.tk, tiling.tn
    return pl.pallas_call(
        functools.partial(_tgmm_kernel, tm=tm),
        grid=(groups, k // tk, n // tn),
        in_specs=[pl.BlockSpec((groups + 1,), lambda g, i, j: (0,)),
                  pl.BlockSpec((m, tk), lambda g, i, j: (0, i)),
                  pl.BlockSpec((m, tn), lambda g, i, j: (0, j))],
        out_specs=pl.BlockSpec((None, tk, tn), lambda g, i, j: (g, i, j)),
        out_shape=jax.ShapeDtypeStruct((groups, k, n), out_dtype),
        name="tgmm",
        **tiling.options(),
    )(offsets, lhs, grad)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _grouped_matmuls(lhs, rhs: tuple, group_sizes, tiling: _Tiling) -> tuple:
    return tuple(_gmm((lhs,), rhs, _group_offsets(group_sizes, lhs.shape[0]), tiling, transpose_rhs=False))


def _grouped_matmuls_fwd(lhs, rhs: tuple, group_sizes, tiling: _Tiling):
    return _grouped_matmuls(lhs, rhs, group_sizes, tiling), (lhs, rhs, group_sizes)


def _grouped_matmuls_bwd(tiling: _Tiling, residuals, grads: tuple):
    lhs, rhs, group_sizes = residuals
    offsets = _group_offsets(group_sizes, lhs.shape[0])
    # d lhs = sum_i grad_i @ rhs_i[g].T: contraction over n (tile tn), output over k (tile tk).
    swapped = dataclasses.replace(tiling, tk=tiling.tn, tn=tiling.tk)
    (d_lhs,) = _gmm(tuple(grads), rhs, offsets, swapped, transpose_rhs=True)
    d_rhs = tuple(_tgmm(lhs, grad, offsets, tiling, r.dtype) for grad, r in zip(grads, rhs, strict=True))
    return d_lhs, d_rhs, None


_grouped_matmuls.defvjp(_grouped_matmuls_fwd, _grouped_matmuls_bwd)


def _make_tiling(tiling, m: int, k: int, n: int, dtype, interpret: bool | None) -> _Tiling:
    """`tiling` (None: the platform's, pallas_kernels.platform_blocks) fitted to the shapes."""
    table = matmul_blocks(_backend.target(), jnp.dtype(dtype).itemsize)
    tm, tk, tn = tiling or table.tiling
    return _Tiling(tm=_backend.block_size(tm, m), tk=_backend.block_size(tk, k),
                   tn=_backend.block_size(tn, n), num_stages=table.num_stages, num_warps=table.num_warps,
                   interpret=_backend.resolve_interpret(interpret))


def _pad2(x, rows: int, cols: int):
    return jnp.pad(x, ((0, rows - x.shape[0]), (0, cols - x.shape[1])))


def grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *,
                   tiling: tuple[int, int, int] | None = None,
                   interpret: bool | None = None) -> jax.Array:
    """`jax.lax.ragged_dot` as a Pallas kernel, differentiable in lhs and rhs.

    lhs: [m, k]; rhs: [g, k, n]; group_sizes: [g] int32 -> [m, n] in the promoted input dtype,
    accumulated in fp32. Rows past sum(group_sizes) are zero. tiling: (tm, tk, tn) powers of two
    (>= 16 on GPU), None for the platform's; m, k, n need not be multiples (padded internally).
    interpret: None = interpret mode on CPU only.
    """
    return grouped_matmuls(lhs, (rhs,), group_sizes, tiling=tiling, interpret=interpret)[0]


def grouped_matmuls(lhs: jax.Array, rhs: Sequence[jax.Array], group_sizes: jax.Array, *,
                    tiling: tuple[int, int, int] | None = None,
                    interpret: bool | None = None) -> tuple[jax.Array, ...]:
    """(`grouped_matmul(lhs, r, group_sizes)` for r in rhs) in one kernel, which loads each lhs
    tile once for all of them (the MoE's gate and up projections); differentiable in lhs and rhs.

    lhs: [m, k]; rhs: p arrays [g, k, n]; group_sizes: [g] int32 -> p arrays [m, n]. tiling and
    interpret as in `grouped_matmul`.
    """
    (m, k), (groups, k_rhs, n) = lhs.shape, rhs[0].shape
    if k != k_rhs or group_sizes.shape != (groups,) or any(r.shape != rhs[0].shape for r in rhs):
        raise ValueError(f"expected lhs [m, k], rhs [g, k, n] (all of one shape), group_sizes [g]; got "
                         f"{lhs.shape}, {[r.shape for r in rhs]}, {group_sizes.shape}")
    dtype = jnp.result_type(lhs, *rhs)
    t = _make_tiling(tiling, m, k, n, dtype, interpret)
    mp, kp, np_ = _backend.round_up(m, t.tm), _backend.round_up(k, t.tk), _backend.round_up(n, t.tn)
    padded = tuple(jnp.pad(r.astype(dtype), ((0, 0), (0, kp - k), (0, np_ - n))) for r in rhs)
    outs = _grouped_matmuls(_pad2(lhs.astype(dtype), mp, kp), padded, group_sizes, t)
    return tuple(out[:m, :n] for out in outs)


def transposed_grouped_matmul(lhs: jax.Array, grad: jax.Array, group_sizes: jax.Array, *,
                              tiling: tuple[int, int, int] | None = None,
                              interpret: bool | None = None) -> jax.Array:
    """tgmm, the weight gradient of `grouped_matmul` (not itself differentiable).

    lhs: [m, k]; grad: [m, n]; group_sizes: [g] int32 -> [g, k, n] in lhs.dtype:
    out[i] = lhs[rows of group i].T @ grad[rows of group i], accumulated in fp32; an empty group
    gives zeros. tiling: (tm, tk, tn) as in `grouped_matmul`.
    """
    (m, k), n = lhs.shape, grad.shape[1]
    if grad.shape[0] != m or group_sizes.ndim != 1:
        raise ValueError(f"expected lhs [m, k], grad [m, n], group_sizes [g]; got {lhs.shape}, "
                         f"{grad.shape}, {group_sizes.shape}")
    t = _make_tiling(tiling, m, k, n, lhs.dtype, interpret)
    mp, kp, np_ = _backend.round_up(m, t.tm), _backend.round_up(k, t.tk), _backend.round_up(n, t.tn)
    out = _tgmm(_pad2(lhs, mp, kp), _pad2(grad.astype(lhs.dtype), mp, np_),
                _group_offsets(group_sizes, mp), t, lhs.dtype)
    return out[:, :k, :n]
