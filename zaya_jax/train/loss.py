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

weighted_nll_sum, for losses linear in the nll (lm, sft: sum(nll * loss_mask)), also takes the
output projection's weight and computes the gradient in the same pass over the chunks, as fused
linear + cross-entropy kernels do (Liger's, tokamax's):
  for each chunk: logits, nll and, by jax.vjp of the chunk, d hidden [B,C,D] and d weight [V,D]
  (accumulated in fp32); the backward pass only scales them by the incoming cotangent.
So the loss head runs 3 matmul passes instead of 4 (no recompute), with one chunk's logits live.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp


def chunk_size_for(seq_len: int, max_chunk: int) -> int:
    """The largest divisor of seq_len that is <= max_chunk."""
    return max(c for c in range(1, min(seq_len, max_chunk) + 1) if seq_len % c == 0)


def _to_chunks(x: jax.Array, n: int) -> jax.Array:
    """[B,S,...] -> [n,B,S/n,...]: the n consecutive chunks of the sequence."""
    return jnp.moveaxis(x.reshape(x.shape[0], n, x.shape[1] // n, *x.shape[2:]), 1, 0)


def _from_chunks(x: jax.Array) -> jax.Array:
    """[n,B,C,...] -> [B,n*C,...] (inverse of _to_chunks)."""
    return jnp.moveaxis(x, 0, 1).reshape(x.shape[1], x.shape[0] * x.shape[2], *x.shape[3:])


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
    s = hidden.shape[1]
    n = s // chunk_size_for(s, max_chunk)
    chunk_nll = jax.checkpoint(lambda h, t: token_nll(logits_fn(h), t))
    if n == 1:
        return chunk_nll(hidden, targets)
    per_chunk = jax.lax.map(lambda chunk: chunk_nll(*chunk), (_to_chunks(hidden, n), _to_chunks(targets, n)))  # [n,B,C]
    return _from_chunks(per_chunk)


def chunked_nll_sum(logits_fn: Callable[[jax.Array], jax.Array], hidden: jax.Array, targets: jax.Array,
                    loss_mask: jax.Array, max_chunk: int) -> jax.Array:
    """Sum over tokens of nll * loss_mask (shapes as chunked_token_nll; loss_mask [B,S] float) -> scalar fp32."""
    return jnp.sum(chunked_token_nll(logits_fn, hidden, targets, max_chunk) * loss_mask.astype(jnp.float32))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 5))
def weighted_nll_sum(logits_fn: Callable[[jax.Array, jax.Array], jax.Array], hidden: jax.Array, weight: jax.Array,
                     targets: jax.Array, token_weights: jax.Array, max_chunk: int) -> jax.Array:
    """sum over tokens of nll * token_weights -> scalar fp32, its gradient computed with its forward.

    logits_fn(hidden [B,C,D], weight) -> [B,C,V] fp32; hidden [B,S,D]; targets [B,S] int;
    token_weights [B,S] float (the loss mask). Differentiable in hidden, weight and token_weights.
    """
    return chunked_nll_sum(lambda h: logits_fn(h, weight), hidden, targets, token_weights, max_chunk)


def _weighted_nll_sum_fwd(logits_fn, hidden, weight, targets, token_weights, max_chunk):
    s = hidden.shape[1]
    n = s // chunk_size_for(s, max_chunk)
    token_weights = token_weights.astype(jnp.float32)

    def chunk(h, t, w):  # -> (nll [B,C]), (d h [B,C,D], d weight [V,D] fp32)
        def value(h, weight):
            nll = token_nll(logits_fn(h, weight), t)
            return jnp.sum(nll * w), nll
        (_, nll), (d_h, d_weight) = jax.value_and_grad(value, argnums=(0, 1), has_aux=True)(h, weight)
        return nll, d_h, d_weight.astype(jnp.float32)

    if n == 1:
        nll, d_hidden, d_weight = chunk(hidden, targets, token_weights)
    else:
        def step(d_weight, xs):
            nll, d_h, d_w = chunk(*xs)
            return d_weight + d_w, (nll, d_h)
        chunks = tuple(_to_chunks(x, n) for x in (hidden, targets, token_weights))
        d_weight, (nll, d_hidden) = jax.lax.scan(step, jnp.zeros(weight.shape, jnp.float32), chunks)
        nll, d_hidden = _from_chunks(nll), _from_chunks(d_hidden)
    return jnp.sum(nll * token_weights), (d_hidden, d_weight, nll)


def _weighted_nll_sum_bwd(logits_fn, max_chunk, residuals, g):
    d_hidden, d_weight, nll = residuals
    return (g * d_hidden).astype(d_hidden.dtype), g * d_weight, None, g * nll


weighted_nll_sum.defvjp(_weighted_nll_sum_fwd, _weighted_nll_sum_bwd)
