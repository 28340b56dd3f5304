"""Compressed Convolutional Attention, CCGQA variant (zaya1-spec section 1.3).

Shapes: B batch, S seq, D hidden, N query heads, K KV heads, H head dim, C = N + K packed heads.

  q0 = x Wq [B,S,N,H], k0 = x Wk [B,S,K,H], P = q0|k0 [B,S,C,H]
  two causal convolutions of kernel 2 along S, padded once (conv0's bias reaches conv1 at t=0):
    Y[t] = w0[0] P[t-1] + w0[1] P[t] + b0              (depthwise)
    Z[t] = W1[0] Y[t-1] + W1[1] Y[t] + b1,  Y[-1] = b0  (grouped: one group per head)
  q = Z_q + (q0 + k0 repeated)/2, k = Z_k + group mean of that (the qk-mean skip)
  L2 norm to sqrt(H), keys times a linear per-KV-head temperature, partial NeoX RoPE
  v: KV heads [0, K/2) from the current token, [K/2, K) from the previous one (value shift)
  o = softmax(q k^T / sqrt(H), causal) v, out = o Wo
The four projections (x Wq, x Wk, x Wv, o Wo) run in model.matmul_precision (an FP8 recipe:
zaya_jax.model.fp8); the convolutions, norms and attention itself in the compute dtype.

What one token hands to the next is a `CCACarry`: P[t], Y[t] and the delayed value
projection x[t] Wv_delayed. `CCA.qkv` takes the previous token's carry (or none at a sequence
start, where P[-1] = 0, Y[-1] = b0 and the delayed value is 0), so the training forward and
token-by-token decoding (zaya_jax.infer) run the same maths.

With `isolate_documents`, the convolutions and the value shift treat each packed document as
if it started the sequence (exactly what the document alone computes); attention never
crosses documents whenever segment ids are given.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from zaya_jax.config import ModelConfig
from zaya_jax.model.kernels import projection_einsum
from zaya_jax.model.params import constant, normal, param
from zaya_jax.model.rope import apply_partial_rope
from zaya_jax.model.vision_lora import CCAVisionLoRA, masked_lora


class CCACarry(NamedTuple):
    """Per token ([B,S,...]) or for the last token of each sequence ([B,...])."""
    packed: jax.Array         # [B,(S),C,H] pre-convolution q0|k0
    depthwise: jax.Array      # [B,(S),C,H] depthwise convolution output Y
    value_delayed: jax.Array  # [B,(S),K/2,H] x Wv_delayed, the next token's delayed value


class QKV(NamedTuple):
    q: jax.Array        # [B,S,N,H] normed, tempered (keys), rotated
    k: jax.Array        # [B,S,K,H]
    v: jax.Array        # [B,S,K,H]
    carry: CCACarry     # [B,S,...] every token's carry


def continues_previous_token(segment_ids: jax.Array | None, batch: int, seq: int) -> jax.Array:
    """[B, S] bool: token t-1 exists and belongs to the same document as token t."""
    not_first = jnp.broadcast_to(jnp.arange(seq) > 0, (batch, seq))
    if segment_ids is None:
        return not_first
    return not_first & (segment_ids == jnp.roll(segment_ids, 1, axis=1))


def previous_token(first: jax.Array, seq: jax.Array, continues: jax.Array, reset: jax.Array) -> jax.Array:
    """seq: [B,S,...] -> each token's predecessor: `first` [B,...] at t = 0, seq[:, t-1] after,
    and `reset` (broadcastable) wherever `continues` [B,S] is False."""
    prev = jnp.concatenate([first[:, None].astype(seq.dtype), seq[:, :-1]], axis=1)
    keep = continues.reshape(continues.shape + (1,) * (seq.ndim - 2))
    return jnp.where(keep, prev, jnp.asarray(reset, seq.dtype))


def l2_normalize(x: jax.Array, radius: float) -> jax.Array:
    """x / ||x|| * radius over the last axis; the norm is clamped at the dtype's eps (as HF)."""
    # max(||x||, eps) as sqrt(max(||x||^2, eps^2)): the same value, and a finite gradient at x = 0
    eps = jnp.finfo(x.dtype).eps
    norm = jnp.sqrt(jnp.maximum(jnp.sum(jnp.square(x.astype(jnp.float32)), axis=-1, keepdims=True), eps * eps))
    return (x.astype(jnp.float32) * (radius / norm)).astype(x.dtype)


class CCA(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, n, k, h = cfg.hidden_size, cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim
        init = normal(cfg.init_std)
        self.q_proj = param(init, rngs.params(), (d, n, h), ("embed", "q_heads", "head_dim"))
        self.k_proj = param(init, rngs.params(), (d, k, h), ("embed", "kv_heads", "head_dim"))
        self.v_proj_current = param(init, rngs.params(), (d, k // 2, h), ("embed", "value_heads", "head_dim"))
        self.v_proj_delayed = param(init, rngs.params(), (d, k // 2, h), ("embed", "value_heads", "head_dim"))
        # Depthwise conv: taps [previous, current] per packed channel.
        self.conv_depthwise_weight = param(init, rngs.params(), (2, n + k, h), (None, "qk_heads", "head_dim"))
        self.conv_depthwise_bias = constant(0.0, (n + k, h), ("qk_heads", "head_dim"))
        # Grouped conv: per head, [tap, in channel, out channel].
        self.conv_grouped_weight = param(init, rngs.params(), (2, n + k, h, h), (None, "qk_heads", "head_dim", None))
        self.conv_grouped_bias = constant(0.0, (n + k, h), ("qk_heads", "head_dim"))
        self.key_temperature = constant(cfg.key_temperature_init, (k,), ("kv_heads",))
        self.o_proj = param(init, rngs.params(), (n, h, d), ("q_heads", "head_dim", "embed"))
        self.num_q_heads = n
        self.matmul_precision = cfg.matmul_precision
        self.isolate_documents = cfg.isolate_documents
        self.vision_lora = CCAVisionLoRA(cfg, rngs=rngs) if cfg.vision_lora_rank_attn else None

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, segment_ids: jax.Array | None,
                 attention: Callable, image_mask: jax.Array | None = None) -> jax.Array:
        """x: [B,S,D] (normed); cos, sin: [B,S,R]; segment_ids: [B,S] or None; image_mask: [B,S]
        bool where the vision LoRA acts (zaya_jax.model.vision_lora), or None -> [B,S,D]."""
        b, s, _ = x.shape
        continues = continues_previous_token(segment_ids if self.isolate_documents else None, b, s)
        q, k, v, _ = self.qkv(x, cos, sin, continues, image_mask=image_mask)
        return self.output(attention(q, k, v, segment_ids), image_mask)

    def start_carry(self, batch: int, dtype) -> CCACarry:
        """The carry before a sequence's first token: P[-1] = 0, Y[-1] = b0, no delayed value."""
        c, h = self.conv_depthwise_bias.shape
        half = self.v_proj_delayed.shape[1]
        b0 = self.conv_depthwise_bias[...].astype(dtype)
        return CCACarry(jnp.zeros((batch, c, h), dtype), jnp.broadcast_to(b0, (batch, c, h)),
                        jnp.zeros((batch, half, h), dtype))

    def qkv(self, x: jax.Array, cos: jax.Array, sin: jax.Array, continues: jax.Array,
            prev: CCACarry | None = None, image_mask: jax.Array | None = None) -> QKV:
        """x: [B,S,D] (normed); cos, sin: [B,S,R]; continues: [B,S] bool (token t-1 feeds the
        convolutions and value shift of token t); prev: the carry of the token before x[:, 0]
        (None: x starts the sequence); image_mask: [B,S] bool or None -> q, k, v and every token's
        carry."""
        dt = x.dtype
        b, s, _ = x.shape
        n = self.num_q_heads
        w = lambda p: p[...].astype(dt)  # noqa: E731
        start = self.start_carry(b, dt)
        prev = start if prev is None else prev
        lora = self.vision_lora if image_mask is not None else None
        project = projection_einsum(self.matmul_precision)
        q0 = project("bsd,dnh->bsnh", x, w(self.q_proj))
        k0 = project("bsd,dkh->bskh", x, w(self.k_proj))
        if lora is not None:
            q0 = q0 + masked_lora(x, lora.q_a[...], lora.q_b[...], image_mask)
            k0 = k0 + masked_lora(x, lora.k_a[...], lora.k_b[...], image_mask)
        kv = k0.shape[2]

        packed = jnp.concatenate([q0, k0], axis=2)                                   # [B,S,C,H]
        w0, b0 = w(self.conv_depthwise_weight), w(self.conv_depthwise_bias)
        y = w0[0] * previous_token(prev.packed, packed, continues, 0.0) + w0[1] * packed + b0
        y_prev = previous_token(prev.depthwise, y, continues, b0)
        w1 = w(self.conv_grouped_weight)
        z = (jnp.einsum("bsci,cio->bsco", y_prev, w1[0]) + jnp.einsum("bsci,cio->bsco", y, w1[1])
             + w(self.conv_grouped_bias))

        q_mean = (q0 + jnp.repeat(k0, n // kv, axis=2)) * 0.5                        # [B,S,N,H]
        k_mean = q_mean.reshape(b, s, kv, n // kv, -1).mean(axis=3)                  # [B,S,K,H]
        radius = q0.shape[-1] ** 0.5
        q = l2_normalize(z[:, :, :n] + q_mean, radius)
        k = l2_normalize(z[:, :, n:] + k_mean, radius) * w(self.key_temperature)[:, None]
        q = apply_partial_rope(q, cos, sin)
        k = apply_partial_rope(k, cos, sin)

        v_current = project("bsd,dkh->bskh", x, w(self.v_proj_current))
        delayed = project("bsd,dkh->bskh", x, w(self.v_proj_delayed))
        if lora is not None:
            v_current = v_current + masked_lora(x, lora.v_current_a[...], lora.v_current_b[...], image_mask)
            delayed = delayed + masked_lora(x, lora.v_delayed_a[...], lora.v_delayed_b[...], image_mask)
        v = jnp.concatenate([v_current, previous_token(prev.value_delayed, delayed, continues, 0.0)], axis=2)
        return QKV(q, k, v, CCACarry(packed, y, delayed))

    def output(self, o: jax.Array, image_mask: jax.Array | None = None) -> jax.Array:
        """o: [B,S,N,H] attention output -> [B,S,D]."""
        out = projection_einsum(self.matmul_precision)("bsnh,nhd->bsd", o, self.o_proj[...].astype(o.dtype))
        if self.vision_lora is not None and image_mask is not None:
            out = out + masked_lora(o, self.vision_lora.o_a[...], self.vision_lora.o_b[...], image_mask)
        return out
