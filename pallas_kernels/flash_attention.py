"""CCA flash attention: Pallas forward and backward kernels joined by a custom_vjp.

The attention core of ZAYA1's CCA (standard causal softmax attention with GQA, 8:2 heads, scale
1/sqrt(128)); CCA's projections, convolutions and q/k norms happen before it, in the model.

B batch, S sequence (padded to Sp), N query heads, M kv heads, G = N // M query heads per kv head,
H head dim (padded to a power of two Hp). Query head n reads kv head n // G.

Query chunks (context parallelism, zaya_jax.parallel.attention_sharding): with `q_offset` the
Sq queries are the rows [q_offset, q_offset + Sq) of a sequence whose Sk keys are all given
(causal only). The offset may be traced; it reaches the kernels as a [1] int32 input and moves
the query positions in the causal mask and in every walk's block bounds. Without it the kernels
are built exactly as for Sq = Sk, offset 0 (no extra inputs).

Algorithm (FlashAttention-2, Triton-style Pallas):
1. forward, grid (query block, B, N): hold one query block, walk key blocks with an online softmax
   in fp32; store the output and the base-2 logsumexp per query.
2. backward `dq`, grid (query block, B, N): the same walk, recomputing probabilities from the
   logsumexp; `delta = rowsum(o * do)` comes from plain JAX.
3. backward `dk, dv`, grid (key block, B, M): hold one key block, walk the query blocks of all G
   query heads that share this kv head, so GQA gradients are summed inside the kernel. It computes
   the transposed tiles k.q^T and v.do^T ([bk, bq]) so p and ds enter the dk and dv matmuls
   untransposed.
With causal attention, key blocks strictly below the diagonal skip the causal mask and blocks
above it are never visited. With a sliding window W (query s sees keys s-W < t <= s), blocks
wholly before every row's window are never visited either (in all three walks) and every
visited block is masked. Logits are scaled by sm_scale * log2(e) so the kernels use exp2.

The forward's output and logsumexp, the residuals the backward needs, carry the checkpoint names
RESIDUAL_NAMES: a remat policy that saves them (zaya_jax.model.zaya's `dots_no_batch_and_kernels`)
keeps the backward from running the forward kernel again.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import pallas as pl

from pallas_kernels import _backend
from pallas_kernels.platform_blocks import attention_blocks

MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite: fully masked blocks stay NaN-free
_NT = (((1,), (1,)), ((), ()))  # a @ b.T
RESIDUAL_NAMES = ("attention_out", "attention_lse")


@dataclasses.dataclass(frozen=True)
class _Config:
    """Static parameters of one attention call (hashable: a custom_vjp nondiff argument)."""
    sm_scale: float
    causal: bool
    window: int | None  # sliding window (keys per query, causal only) or None
    seq_len: int  # queries before padding (S, or Sq); keys past it are masked when not causal
    block_q: int  # blocks, stages and warps of the kernels being built (forward ones until `backward()`)
    block_k: int
    block_q_bwd: int
    block_k_bwd: int
    num_stages: int
    num_warps: int
    num_stages_bwd: int
    num_warps_bwd: int
    interpret: bool

    def backward(self) -> _Config:
        """The same call with the backward blocks, stages and warps in block_q, block_k, num_stages, num_warps."""
        return dataclasses.replace(self, block_q=self.block_q_bwd, block_k=self.block_k_bwd,
                                   num_stages=self.num_stages_bwd, num_warps=self.num_warps_bwd)

    @property
    def logit_scale(self) -> float:
        return self.sm_scale * math.log2(math.e)

    @property
    def kv_len(self) -> int | None:
        """Key-validity bound to mask with, or None when causality already hides the padding."""
        return None if self.causal else self.seq_len

    def options(self) -> dict:
        return _backend.pallas_call_options(self.interpret, num_warps=self.num_warps, num_stages=self.num_stages)


def _logits(a, b, a_pos, b_pos, a_seg, b_seg, *, cfg: _Config, causal_mask: bool, keys_first: bool = False):
    """Masked fp32 logits a @ b.T: q: [bq, Hp] against k: [bk, Hp] -> [bq, bk], or with keys_first
    k against q -> [bk, bq] (the transpose, computed directly); positions and segment ids per row
    of a and b."""
    s = lax.dot_general(a, b, _NT, preferred_element_type=jnp.float32) * cfg.logit_scale
    q_pos, k_pos = (b_pos[None, :], a_pos[:, None]) if keys_first else (a_pos[:, None], b_pos[None, :])
    mask = None
    if causal_mask:
        mask = q_pos >= k_pos
        if cfg.window is not None:
            mask = mask & (k_pos > q_pos - cfg.window)
    if a_seg is not None:
        same = a_seg[:, None] == b_seg[None, :]
        mask = same if mask is None else mask & same
    if cfg.kv_len is not None:
        valid = jnp.broadcast_to(k_pos < cfg.kv_len, s.shape)
        mask = valid if mask is None else mask & valid
    return s if mask is None else jnp.where(mask, s, MASK_VALUE)


def _shift(x, offset):
    """x + offset, or x as it is without an offset (the no-offset kernels stay unchanged)."""
    return x if offset is None else x + offset


def _offset(off_ref):
    """The queries' position offset (a traced int32 scalar), or None."""
    return None if off_ref is None else off_ref[0]


def _chunk_row(position, offset):
    """An absolute query position as a row of the chunk (clamped to 0: before the chunk)."""
    return position if offset is None else jnp.maximum(position - offset, 0)


def _kv_loops(i, cfg: _Config, num_kv_blocks: int, offset=None):
    """Key-block ranges [(start, stop, causal_mask)] seen by query block i (its first row at
    absolute position offset + i * block_q)."""
    if not cfg.causal:
        return [(0, pl.cdiv(cfg.seq_len, cfg.block_k), False)]
    below = lax.div(_shift(i * cfg.block_q, offset), cfg.block_k)  # blocks entirely at or below the diagonal
    stop = jnp.minimum(lax.div(_shift((i + 1) * cfg.block_q, offset) + cfg.block_k - 1, cfg.block_k),
                       num_kv_blocks)
    if cfg.window is not None:  # from the block of the first row's first visible key, all masked
        first = lax.div(jnp.maximum(_shift(i * cfg.block_q, offset) - cfg.window + 1, 0), cfg.block_k)
        return [(first, stop, True)]
    return [(0, below, False), (below, stop, True)]


def _q_loops(j, cfg: _Config, offset=None):
    """Query-block ranges [(start, stop, causal_mask)] that see key block j (real queries only;
    query block i's first row at absolute position offset + i * block_q)."""
    num_q_blocks = pl.cdiv(cfg.seq_len, cfg.block_q)
    if not cfg.causal:
        return [(0, num_q_blocks, False)]
    first = lax.div(_chunk_row(j * cfg.block_k, offset), cfg.block_q)
    above = jnp.maximum(jnp.minimum(pl.cdiv(_chunk_row((j + 1) * cfg.block_k, offset), cfg.block_q),
                                    num_q_blocks),
                        first)  # from here on every query is past every key of the block
    if cfg.window is not None:  # up to the block of the last query that sees the last key, all masked
        if offset is None:
            last = jnp.minimum(lax.div((j + 1) * cfg.block_k + cfg.window - 2, cfg.block_q) + 1, num_q_blocks)
        else:  # the chunk row of the last query that sees the block's last key; none when < 0
            last_row = (j + 1) * cfg.block_k + cfg.window - 2 - offset
            last = jnp.where(last_row < 0, 0, jnp.minimum(lax.div(last_row, cfg.block_q) + 1, num_q_blocks))
        return [(first, jnp.maximum(last, first), True)]
    return [(first, above, True), (above, jnp.maximum(num_q_blocks, above), False)]


def _block(ref, start, size):
    return ref[pl.ds(pl.multiple_of(start, size), size)]


def _query_segments(seg_ref, q_seg_ref):
    """The queries' segment-id ref: their own with an offset, else the keys' (the same rows)."""
    return seg_ref if q_seg_ref is None else q_seg_ref


def _fwd_kernel(q_ref, k_ref, v_ref, seg_ref, q_seg_ref, off_ref, o_ref, lse_ref, *, cfg: _Config):
    """q_ref, o_ref: [bq, Hp]; k_ref, v_ref: [Skp, Hp]; seg_ref: [Skp] or None (keys); q_seg_ref:
    [Sqp] or None (queries, with an offset); off_ref: [1] or None; lse_ref: [bq]."""
    bq, bk = cfg.block_q, cfg.block_k
    i = pl.program_id(0)
    q = q_ref[...]
    offset = _offset(off_ref)
    q_pos = _shift(i * bq + jnp.arange(bq), offset)
    q_seg = None if seg_ref is None else _block(_query_segments(seg_ref, q_seg_ref), i * bq, bq)

    def body(j, carry, causal_mask):
        o, m, row_sum = carry
        k, v = _block(k_ref, j * bk, bk), _block(v_ref, j * bk, bk)
        k_seg = None if seg_ref is None else _block(seg_ref, j * bk, bk)
        s = _logits(q, k, q_pos, j * bk + jnp.arange(bk), q_seg, k_seg, cfg=cfg,
                    causal_mask=causal_mask)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp2(m - m_new)
        p = jnp.exp2(s - m_new[:, None])
        row_sum = alpha * row_sum + jnp.sum(p, axis=1)
        o = alpha[:, None] * o + jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return o, m_new, row_sum

    carry = (jnp.zeros(q.shape, jnp.float32), jnp.full((bq,), -jnp.inf, jnp.float32),
             jnp.zeros((bq,), jnp.float32))
    for start, stop, causal_mask in _kv_loops(i, cfg, k_ref.shape[0] // bk, offset):
        carry = lax.fori_loop(start, stop, functools.partial(body, causal_mask=causal_mask), carry)
    o, m, row_sum = carry
    o_ref[...] = (o / row_sum[:, None]).astype(o_ref.dtype)
    lse_ref[...] = m + jnp.log2(row_sum)


def _dq_kernel(q_ref, k_ref, v_ref, seg_ref, q_seg_ref, off_ref, do_ref, lse_ref, delta_ref, dq_ref, *,
               cfg: _Config):
    """q_ref, do_ref, dq_ref: [bq, Hp]; k_ref, v_ref: [Skp, Hp]; lse_ref, delta_ref: [bq]; the
    rest as in `_fwd_kernel`."""
    bq, bk = cfg.block_q, cfg.block_k
    i = pl.program_id(0)
    q, do = q_ref[...], do_ref[...]
    lse, delta = lse_ref[...], delta_ref[...]
    offset = _offset(off_ref)
    q_pos = _shift(i * bq + jnp.arange(bq), offset)
    q_seg = None if seg_ref is None else _block(_query_segments(seg_ref, q_seg_ref), i * bq, bq)

    def body(j, dq, causal_mask):
        k, v = _block(k_ref, j * bk, bk), _block(v_ref, j * bk, bk)
        k_seg = None if seg_ref is None else _block(seg_ref, j * bk, bk)
        s = _logits(q, k, q_pos, j * bk + jnp.arange(bk), q_seg, k_seg, cfg=cfg,
                    causal_mask=causal_mask)
        p = jnp.exp2(s - lse[:, None])
        dp = lax.dot_general(do, v, _NT, preferred_element_type=jnp.float32)
        ds = p * (dp - delta[:, None])
        return dq + jnp.dot(ds.astype(k.dtype), k, preferred_element_type=jnp.float32)

    dq = jnp.zeros(q.shape, jnp.float32)
    for start, stop, causal_mask in _kv_loops(i, cfg, k_ref.shape[0] // bk, offset):
        dq = lax.fori_loop(start, stop, functools.partial(body, causal_mask=causal_mask), dq)
    dq_ref[...] = (dq * cfg.sm_scale).astype(dq_ref.dtype)


def _dkdv_kernel(q_ref, k_ref, v_ref, seg_ref, q_seg_ref, off_ref, do_ref, lse_ref, delta_ref, dk_ref,
                 dv_ref, *, cfg: _Config):
    """q_ref, do_ref: [Sqp, G, Hp]; k_ref, v_ref, dk_ref, dv_ref: [bk, Hp]; lse_ref, delta_ref:
    [G, Sqp]; seg_ref: [Skp] or None (keys); q_seg_ref: [Sqp] or None (queries, with an offset);
    off_ref: [1] or None."""
    bq, bk = cfg.block_q, cfg.block_k
    j = pl.program_id(0)
    k, v = k_ref[...], v_ref[...]
    offset = _offset(off_ref)
    k_pos = j * bk + jnp.arange(bk)
    k_seg = None if seg_ref is None else _block(seg_ref, j * bk, bk)
    q_seg_ref = _query_segments(seg_ref, q_seg_ref)

    def body(i, carry, g, causal_mask):
        dk, dv = carry
        rows = pl.ds(pl.multiple_of(i * bq, bq), bq)
        q, do = q_ref[rows, g, :], do_ref[rows, g, :]
        lse, delta = lse_ref[g, rows], delta_ref[g, rows]
        q_seg = None if seg_ref is None else q_seg_ref[rows]
        # transposed tiles [bk, bq] computed as k.q^T and v.do^T: the p and ds tiles feed the
        # dk and dv matmuls as they are, with no transpose through shared memory
        s_t = _logits(k, q, k_pos, _shift(i * bq + jnp.arange(bq), offset), k_seg, q_seg, cfg=cfg,
                      causal_mask=causal_mask, keys_first=True)
        p_t = jnp.exp2(s_t - lse[None, :])
        dv = dv + jnp.dot(p_t.astype(do.dtype), do, preferred_element_type=jnp.float32)
        dp_t = lax.dot_general(v, do, _NT, preferred_element_type=jnp.float32)
        ds_t = p_t * (dp_t - delta[None, :])
        dk = dk + jnp.dot(ds_t.astype(q.dtype), q, preferred_element_type=jnp.float32)
        return dk, dv

    carry = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    for g in range(q_ref.shape[1]):
        for start, stop, causal_mask in _q_loops(j, cfg, offset):
            carry = lax.fori_loop(start, stop,
                                  functools.partial(body, g=g, causal_mask=causal_mask), carry)
    dk, dv = carry
    dk_ref[...] = (dk * cfg.sm_scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _seg_spec(seg):
    """Whole rows of segment ids [B, S] (None without them)."""
    return None if seg is None else pl.BlockSpec((None, seg.shape[1]), lambda t, b, h: (b, 0))


def _off_spec(off):
    """The [1] query offset (None without one)."""
    return None if off is None else pl.BlockSpec((1,), lambda t, b, h: (0,))


# jitted: a remat policy saves the named outputs of a call (jit) in the custom_vjp's forward, but
# recomputes a bare pallas_call's even when both its outputs are named (jax 0.10.2 and 0.11.2)
@functools.partial(jax.jit, static_argnames="cfg")
def _forward(q, k, v, seg, q_seg, off, cfg: _Config):
    """Padded q: [B, Sqp, N, Hp], k, v: [B, Skp, M, Hp], seg: [B, Skp] or None (keys), q_seg:
    [B, Sqp] or None (queries, with an offset), off: [1] int32 or None ->
    o: [B, Sqp, N, Hp], lse: [B, N, Sqp] fp32 (base 2). Without an offset Sqp = Skp."""
    batch, seq, heads, dim = q.shape
    group = heads // k.shape[2]
    q_spec = pl.BlockSpec((None, cfg.block_q, None, dim), lambda i, b, h: (b, i, h, 0))
    kv_spec = pl.BlockSpec((None, k.shape[1], None, dim), lambda i, b, h: (b, 0, h // group, 0))
    return pl.pallas_call(
        functools.partial(_fwd_kernel, cfg=cfg),
        grid=(seq // cfg.block_q, batch, heads),
        in_specs=[q_spec, kv_spec, kv_spec, _seg_spec(seg), _seg_spec(q_seg), _off_spec(off)],
        out_specs=[q_spec, pl.BlockSpec((None, None, cfg.block_q), lambda i, b, h: (b, h, i))],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                   jax.ShapeDtypeStruct((batch, heads, seq), jnp.float32)],
        name="cca_flash_attention_fwd",
        **cfg.options(),
    )(q, k, v, seg, q_seg, off)


def _backward(q, k, v, seg, q_seg, off, o, lse, do, cfg: _Config):
    """Padded tensors as in `_forward`, do: [B, Sqp, N, Hp] -> dq, dk, dv."""
    batch, seq, heads, dim = q.shape
    kv_heads = k.shape[2]
    group = heads // kv_heads
    delta = jnp.einsum("bsnh,bsnh->bns", o.astype(jnp.float32), do.astype(jnp.float32))

    q_spec = pl.BlockSpec((None, cfg.block_q, None, dim), lambda i, b, h: (b, i, h, 0))
    kv_spec = pl.BlockSpec((None, k.shape[1], None, dim), lambda i, b, h: (b, 0, h // group, 0))
    row_spec = pl.BlockSpec((None, None, cfg.block_q), lambda i, b, h: (b, h, i))
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, cfg=cfg),
        grid=(seq // cfg.block_q, batch, heads),
        in_specs=[q_spec, kv_spec, kv_spec, _seg_spec(seg), _seg_spec(q_seg), _off_spec(off), q_spec, row_spec,
                  row_spec],
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        name="cca_flash_attention_dq",
        **cfg.options(),
    )(q, k, v, seg, q_seg, off, do, lse, delta)

    grouped = (batch, seq, kv_heads, group, dim)  # query head n = m * G + g
    qg_spec = pl.BlockSpec((None, seq, None, group, dim), lambda j, b, m: (b, 0, m, 0, 0))
    rows_spec = pl.BlockSpec((None, None, group, seq), lambda j, b, m: (b, m, 0, 0))
    k_spec = pl.BlockSpec((None, cfg.block_k, None, dim), lambda j, b, m: (b, j, m, 0))
    dk, dv = pl.pallas_call(
        functools.partial(_dkdv_kernel, cfg=cfg),
        grid=(k.shape[1] // cfg.block_k, batch, kv_heads),
        in_specs=[qg_spec, k_spec, k_spec, _seg_spec(seg), _seg_spec(q_seg), _off_spec(off), qg_spec, rows_spec,
                  rows_spec],
        out_specs=[k_spec, k_spec],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        name="cca_flash_attention_dkdv",
        **cfg.options(),
    )(q.reshape(grouped), k, v, seg, q_seg, off, do.reshape(grouped),
      lse.reshape(batch, kv_heads, group, seq), delta.reshape(batch, kv_heads, group, seq))
    return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _flash(q, k, v, seg, q_seg, off, cfg: _Config):
    return _forward(q, k, v, seg, q_seg, off, cfg)[0]


def _flash_fwd(q, k, v, seg, q_seg, off, cfg: _Config):
    o, lse = (checkpoint_name(x, name) for x, name in zip(_forward(q, k, v, seg, q_seg, off, cfg),
                                                          RESIDUAL_NAMES))
    return o, (q, k, v, seg, q_seg, off, o, lse)


def _flash_bwd(cfg: _Config, residuals, do):
    q, k, v, seg, q_seg, off, o, lse = residuals
    return (*_backward(q, k, v, seg, q_seg, off, o, lse, do, cfg.backward()), None, None, None)


_flash.defvjp(_flash_fwd, _flash_bwd)


def cca_flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, *,
                        segment_ids: jax.Array | None = None, causal: bool = True,
                        sm_scale: float | None = None, block_q: int | None = None,
                        block_k: int | None = None, block_q_bwd: int | None = None,
                        block_k_bwd: int | None = None, interpret: bool | None = None,
                        window: int | None = None, q_offset: jax.Array | int | None = None,
                        kv_segment_ids: jax.Array | None = None) -> jax.Array:
    """Flash attention with GQA, causal, sliding-window and segment (packed-document) masking.

    q: [B, S, N, H]; k, v: [B, S, M, H] with N % M == 0; segment_ids: [B, S] int32 (a query sees
    only keys with its segment id). Returns [B, S, N, H] in q.dtype; differentiable in q, k, v.
    block_q, block_k (forward) and block_q_bwd, block_k_bwd (both backward kernels): powers of two
    (>= 16 on GPU); S need not be a multiple of them (padded and masked). None: the platform's
    (pallas_kernels.platform_blocks, which also sets the pipeline stages and warps).
    interpret: None = interpret mode on CPU only. window: query s sees keys s - window < t <= s
    (needs causal). Matches `attention_reference`.

    A query chunk: with q_offset (an int or int32 scalar, may be traced; needs causal) q: [B, Sq,
    N, H] are the queries at positions [q_offset, q_offset + Sq) and k, v: [B, Sk, M, H] the keys
    at [0, Sk), q_offset + Sq <= Sk; segment_ids: [B, Sq] are the queries' and kv_segment_ids:
    [B, Sk] the keys' (both or neither). The result equals rows [q_offset, q_offset + Sq) of the
    attention of all Sk queries.
    """
    batch, seq, heads, dim = q.shape
    chunk = q_offset is not None
    if k.shape != v.shape or k.shape[0] != batch or k.shape[3] != dim or (not chunk and k.shape[1] != seq):
        raise ValueError(f"expected k, v: [B, S, M, H] matching q {q.shape}; got {k.shape}, "
                         f"{v.shape}")
    if heads % k.shape[2]:
        raise ValueError(f"q heads {heads} not a multiple of kv heads {k.shape[2]}")
    if window is not None and (not causal or window < 1):
        raise ValueError(f"window={window} needs causal attention and window >= 1")
    if segment_ids is not None and segment_ids.shape != (batch, seq):
        raise ValueError(f"segment_ids {segment_ids.shape} != (B, S) = {(batch, seq)}")
    if chunk and (not causal or seq > k.shape[1] or (segment_ids is None) != (kv_segment_ids is None)):
        raise ValueError(f"q_offset needs causal attention, Sq {seq} <= Sk {k.shape[1]} and kv_segment_ids "
                         "exactly when segment_ids are given")
    if not chunk and kv_segment_ids is not None:
        raise ValueError("kv_segment_ids are for a query chunk (q_offset); pass segment_ids alone")
    if kv_segment_ids is not None and kv_segment_ids.shape != k.shape[:2]:
        raise ValueError(f"kv_segment_ids {kv_segment_ids.shape} != (B, Sk) = {k.shape[:2]}")
    table = attention_blocks(_backend.target(), jnp.dtype(q.dtype).itemsize)
    requested = (block_q or table.block_q, block_k or table.block_k, block_q_bwd or table.block_q_bwd,
                 block_k_bwd or table.block_k_bwd)
    blocks = [_backend.block_size(b, k.shape[1]) for b in requested]
    cfg = _Config(sm_scale=dim ** -0.5 if sm_scale is None else float(sm_scale), causal=causal,
                  window=window, seq_len=seq, block_q=blocks[0], block_k=blocks[1], block_q_bwd=blocks[2],
                  block_k_bwd=blocks[3], num_stages=table.num_stages, num_warps=table.num_warps,
                  num_stages_bwd=table.num_stages_bwd, num_warps_bwd=table.num_warps_bwd,
                  interpret=_backend.resolve_interpret(interpret))

    def pad(x):
        """[B, S] or [B, S, heads, H] -> the sequence padded to the blocks, H to a power of two."""
        widths = [(0, 0), (0, _backend.round_up(x.shape[1], max(blocks)) - x.shape[1])]
        if x.ndim == 4:
            widths += [(0, 0), (0, max(16, pl.next_power_of_2(dim)) - dim)]
        return jnp.pad(x, widths)

    seg, q_seg, off = None, None, None
    if segment_ids is not None:
        seg = pad(segment_ids.astype(jnp.int32))
    if chunk:
        off = jnp.reshape(jnp.asarray(q_offset, jnp.int32), (1,))
        q_seg, seg = seg, None if kv_segment_ids is None else pad(kv_segment_ids.astype(jnp.int32))
    out = _flash(pad(q), pad(k), pad(v), seg, q_seg, off, cfg)
    return out[:, :seq, :, :dim]
