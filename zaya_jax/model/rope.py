"""Partial NeoX (rotate-half) rotary embedding, as in ZAYA1's CCA, with transformers' RoPE scaling.

Only the first R = `rotary_dim` dims of each head rotate; the rest pass through. A layer type's
inverse frequencies are transformers' `ROPE_INIT_FUNCTIONS[rope_type]` (modeling_rope_utils) with
their `dim` = R, which is what transformers feeds them for ZAYA (int(head_dim *
partial_rotary_factor)); theta is the layer type's base, M = max_position_embeddings, O =
original_max_position_embeddings, f = factor, j = 0 .. R/2 - 1:

  default   inv_j = theta^(-2j/R)
  linear    inv_j / f
  dynamic   (NTK) at L > M tokens, theta' = theta * (f L / M - (f - 1))^(R / (R - 2)) replaces theta
  yarn      per frequency, a ramp between inv_j (fast rotations, above beta_fast turns in O tokens)
            and inv_j / f (slow ones, below beta_slow); cos and sin times the attention factor
            (0.1 ln f + 1, or the mscale / mscale_all_dim ratio, or attention_factor)
  longrope  inv_j / long_factor_j at L > O tokens, else / short_factor_j; cos and sin times
            sqrt(1 + ln f / ln O) (or attention_factor); f defaults to M / O
  llama3    wavelengths 2 pi / inv_j above O / low_freq_factor divided by f, below O /
            high_freq_factor kept, a smooth blend between

L, the sequence length, is what transformers' `dynamic_rope_update` takes: max(positions) + 1
over the whole call (batch included); prefill passes its longest prompt instead (its padding is
not the sequence). transformers keeps a dynamic table between calls until a call shorter than M;
this is the table of a fresh transformers model, which is the one every decode step and every
call that is not shorter than a previous one above M sees there. The tables are float32, as
transformers computes them.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from zaya_jax.config import RopeScaling

DEFAULT_SCALING = RopeScaling()


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn(s: RopeScaling, theta: float, rotary_dim: int, max_positions: int) -> tuple[jax.Array, float]:
    factor = s.factor or max_positions / s.original_max_position_embeddings
    if s.attention_factor:
        attention = s.attention_factor
    elif s.mscale and s.mscale_all_dim:
        attention = _yarn_mscale(factor, s.mscale) / _yarn_mscale(factor, s.mscale_all_dim)
    else:
        attention = _yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:  # the dim index that turns `rotations` times in O tokens
        turns = s.original_max_position_embeddings / (rotations * 2 * math.pi)
        return rotary_dim * math.log(turns) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    high = high + 0.001 if low == high else high
    ramp = jnp.clip((jnp.arange(rotary_dim // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
    extrapolated = 1 - ramp
    pos_freqs = theta ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim)
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolated) + (1.0 / pos_freqs) * extrapolated
    return inv, attention


def _llama3(s: RopeScaling, inv: jax.Array) -> jax.Array:
    old = s.original_max_position_embeddings
    low_wavelen, high_wavelen = old / s.low_freq_factor, old / s.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = jnp.where(wavelen > low_wavelen, inv / s.factor, inv)
    smooth = (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return jnp.where(medium, smoothed, scaled)


def rope_frequencies(scaling: RopeScaling, theta: float, rotary_dim: int, max_positions: int | None = None,
                     seq_len: jax.Array | None = None) -> tuple[jax.Array, float]:
    """-> inv_freq [R/2] float32 and the factor that multiplies cos and sin. max_positions (M) is
    needed by dynamic and by yarn / longrope with factor 0; seq_len ([] int, L) by dynamic and longrope."""
    exponents = jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim
    default = 1.0 / (theta ** exponents)
    kind = scaling.rope_type
    if kind == "default":
        return default, 1.0
    if kind == "linear":
        return default / scaling.factor, 1.0
    if kind == "dynamic":
        length = jnp.maximum(seq_len, max_positions).astype(jnp.float32)
        growth = scaling.factor * length / max_positions - (scaling.factor - 1)
        base = theta * growth ** (rotary_dim / (rotary_dim - 2))
        return jnp.where(seq_len > max_positions, 1.0 / (base ** exponents), default), 1.0
    if kind == "yarn":
        return _yarn(scaling, theta, rotary_dim, max_positions)
    if kind == "longrope":
        original = scaling.original_max_position_embeddings
        factor = scaling.factor or max_positions / original
        attention = scaling.attention_factor or (1.0 if factor <= 1 else
                                                 math.sqrt(1 + math.log(factor) / math.log(original)))
        extension = jnp.where(seq_len > original, jnp.asarray(scaling.long_factor, jnp.float32),
                              jnp.asarray(scaling.short_factor, jnp.float32))
        return 1.0 / (extension * theta ** exponents), attention
    if kind == "llama3":
        return _llama3(scaling, default), 1.0
    raise ValueError(f"rope_type {kind!r} has no frequencies here")


def rope_cos_sin(positions: jax.Array, rotary_dim: int, theta: float, scaling: RopeScaling = DEFAULT_SCALING,
                 max_positions: int | None = None, seq_len: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """positions: [B, S] int -> cos, sin: [B, S, rotary_dim] float32 (frequencies repeated twice,
    times the attention factor). seq_len: L for dynamic and longrope (default max(positions) + 1)."""
    if seq_len is None:
        seq_len = jnp.max(positions) + 1
    inv_freq, attention = rope_frequencies(scaling, theta, rotary_dim, max_positions, seq_len)
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb) * attention, jnp.sin(emb) * attention


def apply_partial_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x: [B, S, N, H]; cos, sin: [B, S, R] with R <= H  ->  [B, S, N, H]."""
    rot_dim = cos.shape[-1]
    cos = cos[:, :, None, :].astype(x.dtype)
    sin = sin[:, :, None, :].astype(x.dtype)
    x_rot, x_pass = x[..., :rot_dim], x[..., rot_dim:]
    half = rot_dim // 2
    rotated = jnp.concatenate([-x_rot[..., half:], x_rot[..., :half]], axis=-1)
    return jnp.concatenate([x_rot * cos + rotated * sin, x_pass], axis=-1)
