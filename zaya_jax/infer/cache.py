"""The decode state: what generation keeps between tokens, stacked over layers like the model.

Shapes: L layers (Lf full, Ls sliding-window), B sequences, T cache slots (static), W ring slots
of a sliding layer (min(sliding_window, T)), N query heads, K KV heads, H head dim, C = N + K
packed q|k heads.

  keys, values  [Lf,B,T,K,H] the full layers' CCA keys (post L2 norm, temperature and RoPE) and
                             values; slot t holds position t of the sequence
  window_keys, window_values
                [Ls,B,W,K,H] the sliding layers' as a ring buffer: slot t % W holds position t,
                             so it holds the last W positions, all such a layer's next query can
                             see, and stops growing at the window (transformers keeps W - 1
                             and appends the current token: the same keys)
  carry         CCACarry, [L,B,...]: the last token's pre-convolution q|k column P [L,B,C,H]
                and depthwise-conv output Y [L,B,C,H] (all that the two kernel-2 convolutions
                need for the next token) and its delayed-value projection [L,B,K/2,H]
  lengths       [B] int32: tokens held per sequence, i.e. the position of the next token

Layer l's keys sit at index `cache_index(cfg)[l]` of its type's stack. Per token and
attention layer the cache holds 2*K*H numbers: 512 for ZAYA1 (2 KV heads of
128), against 2*16*128 = 4,096 for a 16-head MHA of the same width. The carry is a fixed
2*C*H + K/2*H numbers per sequence and layer. The router's EDA state only links the MoE
blocks of one token, so nothing of it is kept.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np

import jax
import jax.numpy as jnp

from zaya_jax.config import ModelConfig
from zaya_jax.model.cca import CCACarry


class DecodeState(NamedTuple):
    keys: jax.Array           # [Lf,B,T,K,H]
    values: jax.Array         # [Lf,B,T,K,H]
    window_keys: jax.Array    # [Ls,B,W,K,H] ring buffers
    window_values: jax.Array  # [Ls,B,W,K,H]
    carry: CCACarry           # [L,B,C,H], [L,B,C,H], [L,B,K/2,H]
    lengths: jax.Array        # [B] int32


def ring_slots(cfg: ModelConfig, cache_size: int) -> int:
    """W: slots of a sliding layer's ring buffer (positions 0..T-1 never need more than T)."""
    return min(cfg.sliding_window, cache_size) if any(cfg.sliding_layers) else 0


def cache_index(cfg: ModelConfig) -> np.ndarray:
    """[L] int32: each layer's index in its own type's stack (keys or window_keys)."""
    sliding = np.asarray(cfg.sliding_layers)
    return np.where(sliding, np.cumsum(sliding) - 1, np.cumsum(~sliding) - 1).astype(np.int32)


def empty_state(cfg: ModelConfig, batch: int, cache_size: int) -> DecodeState:
    """An all-zero state in the compute dtype (prefill fills it)."""
    dt = jnp.dtype(cfg.dtype)
    layers, kv, h, c = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.num_q_heads + cfg.num_kv_heads
    sliding = sum(cfg.sliding_layers)
    full_shape = (layers - sliding, batch, cache_size, kv, h)
    ring_shape = (sliding, batch, ring_slots(cfg, cache_size), kv, h)
    carry = CCACarry(jnp.zeros((layers, batch, c, h), dt), jnp.zeros((layers, batch, c, h), dt),
                     jnp.zeros((layers, batch, kv // 2, h), dt))
    return DecodeState(jnp.zeros(full_shape, dt), jnp.zeros(full_shape, dt), jnp.zeros(ring_shape, dt),
                       jnp.zeros(ring_shape, dt), carry, jnp.zeros((batch,), jnp.int32))


def state_shapes(cfg: ModelConfig, batch: int, cache_size: int) -> DecodeState:
    """The decode state as jax.ShapeDtypeStructs: no allocation."""
    return jax.eval_shape(functools.partial(empty_state, cfg, batch, cache_size))


def cache_numbers_per_token(cfg: ModelConfig) -> int:
    """Numbers the KV cache holds per token per attention layer (per slot of either stack), read
    off the abstract state."""
    batch, slots = 1, 8
    state = state_shapes(cfg, batch, slots)
    held = state.keys.size + state.values.size + state.window_keys.size + state.window_values.size
    sliding = sum(cfg.sliding_layers)
    return held // (batch * ((cfg.num_layers - sliding) * slots + sliding * ring_slots(cfg, slots)))


def cache_bytes(cfg: ModelConfig, batch: int, cache_size: int) -> int:
    """Bytes of the keys and values a decode state of T = cache_size slots holds (both stacks)."""
    state = state_shapes(cfg, batch, cache_size)
    return sum(x.size * x.dtype.itemsize for x in (state.keys, state.values, state.window_keys, state.window_values))


def ring_from_prompt(kv: jax.Array, lengths: jax.Array, slots: int) -> jax.Array:
    """kv: [Ls,B,S,K,H] every prompt position; lengths: [B] -> [Ls,B,W=slots,K,H], slot j holding
    the latest position t < length with t % W == j (slots no position fills yet hold position 0,
    hidden by the decode mask until written)."""
    held = jnp.clip(ring_positions(lengths, slots), 0, kv.shape[2] - 1)  # [B,W]
    return jnp.take_along_axis(kv, held[None, :, :, None, None], axis=2)


def ring_positions(lengths: jax.Array, slots: int) -> jax.Array:
    """lengths: [B] tokens held -> [B,W=slots] int32: the position each ring slot holds (slot j: the
    latest position t < length with t % W == j), negative where no position has filled it yet."""
    last = lengths[:, None] - 1
    return last - (last - jnp.arange(slots)[None, :]) % slots


def chunk_attention(q: jax.Array, keys: jax.Array, values: jax.Array, visible: jax.Array) -> jax.Array:
    """q: [B,C,N,H]; keys, values: [B,S,K,H]; visible: [B,C,S] bool (query c sees key s) -> [B,C,N,H].

    Query head n uses KV head n // (N // K); logits and softmax in fp32, scale 1/sqrt(H), as
    zaya_jax.model.attention_core.xla_attention. A query that sees no key gets garbage (the
    chunk's padding)."""
    b, c, n, h = q.shape
    kv = keys.shape[2]
    qg = q.reshape(b, c, kv, n // kv, h)
    logits = jnp.einsum("bckgh,bskh->bckgs", qg, keys, preferred_element_type=jnp.float32) * (h ** -0.5)
    logits = jnp.where(visible[:, :, None, None], logits, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(logits, axis=-1).astype(values.dtype)
    return jnp.einsum("bckgs,bskh->bckgh", weights, values).reshape(b, c, n, h)
