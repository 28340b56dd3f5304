"""Causal GQA softmax attention: the XLA path, blocked along the queries.

This is the always-working path; the Pallas flash kernel (pallas_kernels/) is chosen by
`zaya_jax.model.kernels.attention_fn` and both are tested against
`pallas_kernels.attention_reference`.

The queries are cut into at most MAX_QUERY_BLOCKS blocks of c rows (at least MIN_QUERY_BLOCK);
block i only reads the keys [0, end of block i), so the masked upper triangle is mostly never
computed (about half the logits at many blocks). With a sliding window W (query s sees keys
s-W < t <= s, transformers' `sliding_window`), block i also starts reading at its first row's
first visible key, so keys before every row's window are never computed either. Each KV head's
G query heads are one matmul operand ([G*c, H] against [L, H]), which XLA runs as one dot per
(batch, KV head).

With `bidirectional` [B, S] bool (ZAYA1-VL's image positions), a pair of such positions is visible
both ways (within a document), on top of the causal or windowed pattern; every block then reads
all keys, since an image query sees the image keys after it.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

MAX_QUERY_BLOCKS = 16
MIN_QUERY_BLOCK = 64


def query_block_size(seq: int) -> int:
    return max(MIN_QUERY_BLOCK, math.ceil(seq / MAX_QUERY_BLOCKS))


def first_visible_key(q_start: int, window: int | None) -> int:
    """The first key any query row >= q_start can see (0 without a window)."""
    return 0 if window is None else max(0, q_start - window + 1)


def block_mask(segment_ids: jax.Array | None, q_start: int, q_end: int, window: int | None = None,
               k_start: int | None = None, k_end: int | None = None,
               bidirectional: jax.Array | None = None) -> jax.Array:
    """Query rows [q_start, q_end) against keys [k_start, k_end) (default: first_visible_key to
    q_end): causal, within `window` keys (query s sees s-window < t <= s) when given, or both
    positions in `bidirectional` [B, S] when given; and the same document when segment_ids [B, S]
    are given -> [B or 1, 1, 1, c, k_end - k_start] bool."""
    k_start = first_visible_key(q_start, window) if k_start is None else k_start
    k_end = q_end if k_end is None else k_end
    keys, queries = jnp.arange(k_start, k_end)[None, :], jnp.arange(q_start, q_end)[:, None]
    visible = keys <= queries
    if window is not None:
        visible = visible & (keys > queries - window)
    visible = visible[None]
    if bidirectional is not None:
        visible = visible | (bidirectional[:, q_start:q_end, None] & bidirectional[:, None, k_start:k_end])
    if segment_ids is None:
        return visible[:, None, None]
    same_doc = segment_ids[:, q_start:q_end, None] == segment_ids[:, None, k_start:k_end]
    return (visible & same_doc)[:, None, None]


def xla_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None,
                  window: int | None = None, bidirectional: jax.Array | None = None) -> jax.Array:
    """q: [B, S, N, H]; k, v: [B, S, K, H]; segment_ids: [B, S] or None; window: keys per query
    (sliding-window attention) or None (full causal); bidirectional: [B, S] bool or None (positions
    that see each other both ways)  ->  [B, S, N, H].

    Query head n uses KV head n // (N // K). Logits and softmax in fp32, scale 1/sqrt(H).
    """
    b, s, n, h = q.shape
    kv = k.shape[2]
    qt = q.reshape(b, s, kv, n // kv, h).transpose(0, 2, 3, 1, 4)  # [B,K,G,S,H]
    kt, vt = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)      # [B,K,S,H]
    block = query_block_size(s)
    outs = []
    for start in range(0, s, block):
        end = min(start + block, s)
        keys = slice(0, s) if bidirectional is not None else slice(first_visible_key(start, window), end)
        logits = jnp.einsum("bkgch,bkth->bkgct", qt[:, :, :, start:end], kt[:, :, keys],
                            preferred_element_type=jnp.float32) * (h ** -0.5)
        mask = block_mask(segment_ids, start, end, window, keys.start, keys.stop, bidirectional)
        logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
        weights = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
        outs.append(jnp.einsum("bkgct,bkth->bkgch", weights, vt[:, :, keys]))
    out = jnp.concatenate(outs, axis=3)                             # [B,K,G,S,H]
    return out.transpose(0, 3, 1, 2, 4).reshape(b, s, n, h)
