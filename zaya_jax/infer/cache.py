"""The decode state: what generation keeps between tokens, stacked over layers like the model.

Shapes: L layers, B sequences, T cache slots (static), N query heads, K KV heads, H head dim,
C = N + K packed q|k heads.

  keys, values  [L,B,T,K,H]  CCA's keys (post L2 norm, temperature and RoPE) and values; slot t
                             holds position t of the sequence
  carry         CCACarry, [L,B,...]: the last token's pre-convolution q|k column P [L,B,C,H]
                and depthwise-conv output Y [L,B,C,H] (all that the two kernel-2 convolutions
                need for the next token) and its delayed-value projection [L,B,K/2,H]
  lengths       [B] int32: tokens held per sequence, i.e. the position of the next token

Per token and attention layer the cache holds 2*K*H numbers: 512 for ZAYA1 (2 KV heads of
128), against 2*16*128 = 4,096 for a 16-head MHA of the same width. The carry is a fixed
2*C*H + K/2*H numbers per sequence and layer. The router's EDA state only links the MoE
blocks of one token, so nothing of it is kept.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from zaya_jax.config import ModelConfig
from zaya_jax.model.cca import CCACarry


class DecodeState(NamedTuple):
    keys: jax.Array     # [L,B,T,K,H]
    values: jax.Array   # [L,B,T,K,H]
    carry: CCACarry     # [L,B,C,H], [L,B,C,H], [L,B,K/2,H]
    lengths: jax.Array  # [B] int32


def empty_state(cfg: ModelConfig, batch: int, cache_size: int) -> DecodeState:
    """An all-zero state in the compute dtype (prefill fills it)."""
    dt = jnp.dtype(cfg.dtype)
    layers, kv, h, c = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.num_q_heads + cfg.num_kv_heads
    kv_shape = (layers, batch, cache_size, kv, h)
    carry = CCACarry(jnp.zeros((layers, batch, c, h), dt), jnp.zeros((layers, batch, c, h), dt),
                     jnp.zeros((layers, batch, kv // 2, h), dt))
    return DecodeState(jnp.zeros(kv_shape, dt), jnp.zeros(kv_shape, dt), carry, jnp.zeros((batch,), jnp.int32))


def state_shapes(cfg: ModelConfig, batch: int, cache_size: int) -> DecodeState:
    """The decode state as jax.ShapeDtypeStructs: no allocation."""
    return jax.eval_shape(functools.partial(empty_state, cfg, batch, cache_size))


def cache_numbers_per_token(cfg: ModelConfig) -> int:
    """Numbers the KV cache holds per token per attention layer, read off the abstract state."""
    batch, slots = 1, 8
    state = state_shapes(cfg, batch, slots)
    return (state.keys.size + state.values.size) // (cfg.num_layers * batch * slots)


def cached_attention(q: jax.Array, keys: jax.Array, values: jax.Array, positions: jax.Array) -> jax.Array:
    """q: [B,1,N,H] at `positions` [B]; keys, values: [B,T,K,H] holding slots 0..positions -> [B,1,N,H].

    Query head n uses KV head n // (N // K); logits and softmax in fp32, scale 1/sqrt(H), as
    zaya_jax.model.attention_core.xla_attention.
    """
    b, _, n, h = q.shape
    kv = keys.shape[2]
    qg = q.reshape(b, kv, n // kv, h)
    logits = jnp.einsum("bkgh,btkh->bkgt", qg, keys, preferred_element_type=jnp.float32) * (h ** -0.5)
    visible = jnp.arange(keys.shape[1])[None, :] <= positions[:, None]                 # [B,T]
    logits = jnp.where(visible[:, None, None], logits, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(logits, axis=-1).astype(values.dtype)
    return jnp.einsum("bkgt,btkh->bkgh", weights, values).reshape(b, 1, n, h)
