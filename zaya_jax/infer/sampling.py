"""Choosing the next token from logits: greedy, or temperature sampling with top-k / top-p.

  temperature == 0   argmax (greedy; top_k and top_p are irrelevant)
  temperature > 0    logits / temperature, then keep the top_k largest (if set), then the
                     smallest set of largest-probability tokens whose mass reaches top_p (if set;
                     the most likely token is always kept), then sample.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class Sampler(NamedTuple):
    """Static sampling settings (hashable: one compiled decode loop per distinct sampler)."""
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None

    def validate(self, vocab_size: int) -> "Sampler":
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if self.top_k is not None and not (isinstance(self.top_k, int) and 1 <= self.top_k <= vocab_size):
            raise ValueError(f"top_k must be an integer in [1, vocab_size={vocab_size}], got {self.top_k!r}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p!r}")
        return self


def filter_logits(logits: jax.Array, sampler: Sampler) -> jax.Array:
    """logits: [B,V] float32 -> tempered logits with the tokens top_k / top_p drop set to -inf."""
    b, v = logits.shape
    per_row = lambda value, off: jnp.full((b,), off if value is None else value)  # noqa: E731
    return filter_rows(logits, per_row(sampler.temperature, 1.0), per_row(sampler.top_k, v), per_row(sampler.top_p, 1.0))


def filter_rows(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """filter_logits with settings per row, as arrays (no static shape per setting): logits [B,V]
    float32; temperature [B] > 0; top_k [B] int in [1, V] (V: off); top_p [B] in (0, 1] (1: off)."""
    logits = logits / temperature[:, None]
    ordered = jnp.sort(logits, axis=-1)[:, ::-1]
    kth = jnp.take_along_axis(ordered, top_k[:, None].astype(jnp.int32) - 1, axis=-1)
    logits = jnp.where(logits < kth, -jnp.inf, logits)
    ordered = jnp.where(ordered < kth, -jnp.inf, ordered)
    probs = jax.nn.softmax(ordered, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    # the smallest kept logit: the last sorted one whose preceding mass is still below top_p
    threshold = jnp.min(jnp.where(mass_before < top_p[:, None], ordered, jnp.inf), axis=-1, keepdims=True)
    threshold = jnp.where(top_p[:, None] < 1, threshold, -jnp.inf)
    return jnp.where(logits < threshold, -jnp.inf, logits)


def sample(logits: jax.Array, key: jax.Array, sampler: Sampler) -> jax.Array:
    """logits: [B,V] float32 -> next tokens [B] int32."""
    if sampler.temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, filter_logits(logits, sampler), axis=-1).astype(jnp.int32)
