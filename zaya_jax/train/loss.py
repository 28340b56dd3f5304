"""Next-token cross-entropy in fp32, chunked over the sequence so [B,S,V] logits never exist.

B batch, S seq, C chunk, D hidden, V vocab. The data pipeline already shifts: `targets[t]` is
the token after `inputs[t]`, and `loss_mask` is 1 on real targets (0 on padding).

  for each chunk of C positions (lax.map, each step under jax.checkpoint):
      logits = logits_fn(hidden[:, chunk])                [B,C,V] fp32
      nll[:, chunk] = logsumexp(logits) - logits[target]  [B,C]
  chunked_token_nll returns nll [B,S] (DPO sums it per sequence); chunked_nll_sum = sum(nll * loss_mask).
Only one chunk's logits are live in the forward pass and, because of the checkpoint, in the
backward pass too (they are recomputed there). At ZAYA1 scale (V=262,272, S=4096) a chunk of
512 positions keeps 0.5 GiB of logits per sequence instead of 4 GiB.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp


def chunk_size_for(seq_len: int, max_chunk: int) -> int:
    """The largest divisor of seq_len that is <= max_chunk."""
    return max(c for c in range(1, min(seq_len, max_chunk) + 1) if seq_len % c == 0)


def token_nll(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """logits [..., V] fp32, targets [...] int -> negative log-likelihood [...]."""
    logits = logits.astype(jnp.float32)
    return jax.nn.logsumexp(logits, axis=-1) - jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]


def chunked_token_nll(logits_fn: Callable[[jax.Array], jax.Array], hidden: jax.Array, targets: jax.Array,
                      max_chunk: int) -> jax.Array:
    """Per-token nll [B,S] fp32, computed chunk by chunk (only one chunk's logits are live).

    logits_fn: [B,C,D] -> [B,C,V] fp32 (the model's tied output projection)
    hidden: [B,S,D] final-normed; targets: [B,S] int
    """
    b, s, d = hidden.shape
    c = chunk_size_for(s, max_chunk)
    n = s // c
    chunk_nll = jax.checkpoint(lambda h, t: token_nll(logits_fn(h), t))
    if n == 1:
        return chunk_nll(hidden, targets)

    def to_chunks(x):  # [B,S,...] -> [n,B,C,...]
        return jnp.moveaxis(x.reshape(b, n, c, *x.shape[2:]), 1, 0)

    per_chunk = jax.lax.map(lambda chunk: chunk_nll(*chunk), (to_chunks(hidden), to_chunks(targets)))  # [n,B,C]
    return jnp.moveaxis(per_chunk, 0, 1).reshape(b, s)


def chunked_nll_sum(logits_fn: Callable[[jax.Array], jax.Array], hidden: jax.Array, targets: jax.Array,
                    loss_mask: jax.Array, max_chunk: int) -> jax.Array:
    """Sum over tokens of nll * loss_mask (shapes as chunked_token_nll; loss_mask [B,S] float) -> scalar fp32."""
    return jnp.sum(chunked_token_nll(logits_fn, hidden, targets, max_chunk) * loss_mask.astype(jnp.float32))
