"""Causal GQA softmax attention: the XLA path, blocked along the queries.

This is the always-working path; the Pallas flash kernel (pallas_kernels/) is chosen by
`zaya_jax.model.kernels.attention_fn` and both are tested against
`pallas_kernels.attention_reference`.

The queries are cut into at most MAX_QUERY_BLOCKS blocks of c rows (at least MIN_QUERY_BLOCK);
block i only reads the keys [0, end of block i), so the masked upper triangle is mostly never
computed (about half the logits at many blocks). Each KV head's G query heads are one matmul
operand ([G*c, H] against [L, H]), which XLA runs as one dot per (batch, KV head).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

MAX_QUERY_BLOCKS = 16
MIN_QUERY_BLOCK = 64


def query_block_size(seq: int) -> int:
    return max(MIN_QUERY_BLOCK, math.ceil(seq / MAX_QUERY_BLOCKS))


def block_mask(segment_ids: jax.Array | None, q_start: int, q_end: int) -> jax.Array:
    """Query rows [q_start, q_end) against keys [0, q_end): causal, and the same document when
    segment_ids [B, S] are given -> [B or 1, 1, 1, c, q_end] bool (query s attends key t)."""
    causal = jnp.arange(q_end)[None, :] <= jnp.arange(q_start, q_end)[:, None]
    if segment_ids is None:
        return causal[None, None, None]
    same_doc = segment_ids[:, q_start:q_end, None] == segment_ids[:, None, :q_end]
    return (causal & same_doc)[:, None, None]


def xla_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None) -> jax.Array:
    """q: [B, S, N, H]; k, v: [B, S, K, H]; segment_ids: [B, S] or None  ->  [B, S, N, H].

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
        logits = jnp.einsum("bkgch,bkth->bkgct", qt[:, :, :, start:end], kt[:, :, :end],
                            preferred_element_type=jnp.float32) * (h ** -0.5)
        logits = jnp.where(block_mask(segment_ids, start, end), logits, jnp.finfo(jnp.float32).min)
        weights = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
        outs.append(jnp.einsum("bkgct,bkth->bkgch", weights, vt[:, :, :end]))
    out = jnp.concatenate(outs, axis=3)                             # [B,K,G,S,H]
    return out.transpose(0, 3, 1, 2, 4).reshape(b, s, n, h)
