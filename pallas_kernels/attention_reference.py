"""Plain-JAX attention with explicit masks: the specification of `cca_flash_attention`.

B batch, S sequence, N query heads, M kv heads (N % M == 0), H head dim.
Query head n reads kv head n // (N // M) (grouped-query attention; ZAYA1 uses 8:2).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_HIGHEST = jax.lax.Precision.HIGHEST


def attention_mask(seq_len: int, segment_ids: jax.Array | None, causal: bool,
                   window: int | None = None) -> jax.Array:
    """Which keys each query may see. segment_ids: [B, S] int32; window: query s sees keys
    s - window < t <= s (causal only) -> bool [B or 1, 1, S, S]."""
    mask = jnp.ones((1, 1, seq_len, seq_len), bool)
    if causal:
        mask = jnp.tril(mask)
    if window is not None:
        mask = mask & jnp.triu(mask, -(window - 1))
    if segment_ids is not None:
        same = segment_ids[:, :, None] == segment_ids[:, None, :]
        mask = mask & same[:, None]
    return mask


def attention_reference(q: jax.Array, k: jax.Array, v: jax.Array, *,
                        segment_ids: jax.Array | None = None, causal: bool = True,
                        sm_scale: float | None = None, window: int | None = None) -> jax.Array:
    """Softmax attention in fp32.

    q: [B, S, N, H]; k, v: [B, S, M, H]; segment_ids: [B, S] int32 (a query sees only keys of its
    own segment); window: sliding-window attention (query s sees keys s - window < t <= s; needs
    causal). Returns [B, S, N, H] in q.dtype. Every query must see at least one key (with
    causal attention the diagonal is always visible).
    """
    num_heads, num_kv_heads, head_dim = q.shape[2], k.shape[2], q.shape[3]
    if num_heads % num_kv_heads:
        raise ValueError(f"q heads {num_heads} not a multiple of kv heads {num_kv_heads}")
    scale = head_dim ** -0.5 if sm_scale is None else sm_scale
    group = num_heads // num_kv_heads
    k = jnp.repeat(k.astype(jnp.float32), group, axis=2)
    v = jnp.repeat(v.astype(jnp.float32), group, axis=2)
    logits = jnp.einsum("bqnh,bknh->bnqk", q.astype(jnp.float32), k, precision=_HIGHEST) * scale
    mask = attention_mask(q.shape[1], segment_ids, causal, window)
    logits = jnp.where(mask, logits, -jnp.inf)
    weights = jax.nn.softmax(logits, axis=-1)
    return jnp.einsum("bnqk,bknh->bqnh", weights, v, precision=_HIGHEST).astype(q.dtype)
