"""Grouped matmul (MoE experts) as Pallas kernels: `jax.lax.ragged_dot` semantics, with custom_vjp.

m rows (tokens sorted by expert), k contraction, n output columns, g groups (experts); lhs rows
belong to groups consecutively, rows past sum(group_sizes) to none (their output is zero).

Kernels (Triton-style Pallas, no scalar prefetch, no atomics, so every program owns its output):
1. `gmm`, grid (m tile, n tile): before the pallas_call, plain JAX computes which groups each row
   tile touches (`_tile_groups`). A tile inside one group runs one k loop; a tile that straddles
   a boundary runs one k loop per group it touches, loading the rows of the other groups as zeros
   (masked loads, no select on the operand), and sums them in one fp32 accumulator. Empty groups
   skip their k loop.
   Transposed-rhs mode (`lhs @ rhs[g].T`) gives the lhs gradient without copying rhs.
2. `tgmm`, grid (group, k tile, n tile): out[g] = lhs[rows of g].T @ grad[rows of g], walking
   only the row tiles of group g, rows outside it loaded as zeros; an empty group writes zeros.
`grouped_matmul`'s custom_vjp uses gmm for d lhs and tgmm for d rhs.
"""

from __future__ import annotations

import dataclasses
import functools

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
    """Power-of-two tiles along m, k, n (hashable: a custom_vjp nondiff argument)."""
    tm: int
    tk: int
    tn: int
    num_stages: int
    interpret: bool

    def options(self, rows: int, cols: int) -> dict:
        warps = 8 if rows * cols >= 128 * 128 else 4
        return _backend.pallas_call_options(self.interpret, num_warps=warps, num_stages=self.num_stages)


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


def _gmm_kernel(offsets_ref, first_ref, stop_ref, lhs_ref, rhs_ref, out_ref, *, tc: int,
                transpose_rhs: bool):
    """lhs_ref: [tm, C]; rhs_ref: [g, C, to] (or [g, to, C] when transpose_rhs); out_ref: [tm, to];
    offsets_ref: [g + 1]; first_ref, stop_ref: [m tiles]. C is the contraction, tc its tile."""
    t = pl.program_id(0)
    tm = lhs_ref.shape[0]
    rows = t * tm + jnp.arange(tm)
    num_c = lhs_ref.shape[1] // tc

    def group_body(group, acc):
        lo, hi = offsets_ref[group], offsets_ref[group + 1]
        member = ((rows >= lo) & (rows < hi))[:, None]

        def c_body(c, acc):
            cols = pl.ds(pl.multiple_of(c * tc, tc), tc)
            x = plgpu.load(lhs_ref.at[:, cols], mask=jnp.broadcast_to(member, (tm, tc)), other=0)
            if transpose_rhs:
                return acc + lax.dot_general(x, rhs_ref[group, :, cols], _NT,
                                             preferred_element_type=jnp.float32)
            return acc + jnp.dot(x, rhs_ref[group, cols, :], preferred_element_type=jnp.float32)

        return lax.fori_loop(0, jnp.where(hi > lo, num_c, 0), c_body, acc)

    acc = jnp.zeros(out_ref.shape, jnp.float32)
    acc = lax.fori_loop(first_ref[t], stop_ref[t], group_body, acc)
    out_ref[...] = acc.astype(out_ref.dtype)


def _gmm(lhs, rhs, offsets, tiling: _Tiling, *, transpose_rhs: bool):
    """Padded lhs: [m, c], rhs: [g, c, o] (or [g, o, c]), offsets: [g + 1] -> [m, o].
    Tiles: tm along m, tk along c, tn along o (both multiples of their tiles)."""
    (m, c), groups = lhs.shape, rhs.shape[0]
    o = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    tm, tc, to = tiling.tm, tiling.tk, tiling.tn
    num_tiles = m // tm
    first, stop = _tile_groups(offsets, num_tiles, tm)
    if transpose_rhs:
        rhs_spec = pl.BlockSpec((groups, to, c), lambda t, j: (0, j, 0))
    else:
        rhs_spec = pl.BlockSpec((groups, c, to), lambda t, j: (0, 0, j))
    return pl.pallas_call(
        functools.partial(_gmm_kernel, tc=tc, transpose_rhs=transpose_rhs),
        grid=(num_tiles, o // to),
        in_specs=[pl.BlockSpec((groups + 1,), lambda t, j: (0,)),
                  pl.BlockSpec((num_tiles,), lambda t, j: (0,)),
                  pl.BlockSpec((num_tiles,), lambda t, j: (0,)),
                  pl.BlockSpec((tm, c), lambda t, j: (t, 0)),
                  rhs_spec],
        out_specs=pl.BlockSpec((tm, to), lambda t, j: (t, j)),
        out_shape=jax.ShapeDtypeStruct((m, o), lhs.dtype),
        name="gmm_transposed_rhs" if transpose_rhs else "gmm",
        **tiling.options(tm, to),
    )(offsets, first, stop, lhs, rhs)


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
        **tiling.options(tk, tn),
    )(offsets, lhs, grad)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _grouped_matmul(lhs, rhs, group_sizes, tiling: _Tiling):
    return _gmm(lhs, rhs, _group_offsets(group_sizes, lhs.shape[0]), tiling, transpose_rhs=False)


def _grouped_matmul_fwd(lhs, rhs, group_sizes, tiling: _Tiling):
    return _grouped_matmul(lhs, rhs, group_sizes, tiling), (lhs, rhs, group_sizes)


def _grouped_matmul_bwd(tiling: _Tiling, residuals, grad):
    lhs, rhs, group_sizes = residuals
    offsets = _group_offsets(group_sizes, lhs.shape[0])
    # d lhs = grad @ rhs[g].T: contraction over n (tile tn), output over k (tile tk).
    swapped = dataclasses.replace(tiling, tk=tiling.tn, tn=tiling.tk)
    d_lhs = _gmm(grad, rhs, offsets, swapped, transpose_rhs=True)
    d_rhs = _tgmm(lhs, grad, offsets, tiling, rhs.dtype)
    return d_lhs, d_rhs, None


_grouped_matmul.defvjp(_grouped_matmul_fwd, _grouped_matmul_bwd)


def _make_tiling(tiling, m: int, k: int, n: int, dtype, interpret: bool | None) -> _Tiling:
    """`tiling` (None: the platform's, pallas_kernels.platform_blocks) fitted to the shapes."""
    table = matmul_blocks(_backend.target(), jnp.dtype(dtype).itemsize)
    tm, tk, tn = tiling or table.tiling
    return _Tiling(tm=_backend.block_size(tm, m), tk=_backend.block_size(tk, k),
                   tn=_backend.block_size(tn, n), num_stages=table.num_stages,
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
    (m, k), (groups, k_rhs, n) = lhs.shape, rhs.shape
    if k != k_rhs or group_sizes.shape != (groups,):
        raise ValueError(f"expected lhs [m, k], rhs [g, k, n], group_sizes [g]; got "
                         f"{lhs.shape}, {rhs.shape}, {group_sizes.shape}")
    dtype = jnp.result_type(lhs, rhs)
    t = _make_tiling(tiling, m, k, n, dtype, interpret)
    mp, kp, np_ = _backend.round_up(m, t.tm), _backend.round_up(k, t.tk), _backend.round_up(n, t.tn)
    rhs = jnp.pad(rhs.astype(dtype), ((0, 0), (0, kp - k), (0, np_ - n)))
    out = _grouped_matmul(_pad2(lhs.astype(dtype), mp, kp), rhs, group_sizes, t)
    return out[:m, :n]


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
