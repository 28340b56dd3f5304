"""Causal GQA softmax attention: the XLA reference path.

This is the always-working path; the Pallas flash kernel (pallas_kernels/) is chosen by
`zaya_jax.model.kernels.attention_fn` and tested against this function.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def attention_mask(segment_ids: jax.Array | None, batch: int, seq: int) -> jax.Array:
    """Causal mask, restricted to the same document when `segment_ids` [B, S] are given.

    -> [B, 1, 1, S, S] bool (query s attends key t).
    """
    causal = jnp.tril(jnp.ones((seq, seq), dtype=bool))[None, None, None]
    if segment_ids is None:
        return jnp.broadcast_to(causal, (batch, 1, 1, seq, seq))
    same_doc = segment_ids[:, :, None] == segment_ids[:, None, :]
    return causal & same_doc[:, None, None]


def xla_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None) -> jax.Array:
    """q: [B, S, N, H]; k, v: [B, S, K, H]; segment_ids: [B, S] or None  ->  [B, S, N, H].

    Query head n uses KV head n // (N // K). Logits and softmax in fp32, scale 1/sqrt(H).
    """
    b, s, n, h = q.shape
    kv = k.shape[2]
    qg = q.reshape(b, s, kv, n // kv, h)
    logits = jnp.einsum("bskgh,btkh->bkgst", qg, k, preferred_element_type=jnp.float32) * (h ** -0.5)
    logits = jnp.where(attention_mask(segment_ids, b, s), logits, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgst,btkh->bskgh", weights, v)
    return out.reshape(b, s, n, h)
