"""One compiled engine iteration: extend every slot by its chunk, then choose each row's next token.

Shapes: N slots, C tokens per slot and call (the prefill chunk, or 1 for a decode step), V vocab,
K = max_top_logprobs. One jitted function serves both; each (C, K) is one compilation. The state
is donated: the step updates the engine's cache in place instead of copying it.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from zaya_jax.infer.cache import DecodeState
from zaya_jax.infer.decode import extend
from zaya_jax.infer.sampling import filter_rows


class RowSampling(NamedTuple):
    """Each row's settings, [N] arrays: temperature (0: greedy), top_k (V: off), top_p (1: off),
    seed and the index of the token being chosen (its random key: fold_in(key(seed), index))."""
    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    seed: jax.Array
    index: jax.Array


class Picked(NamedTuple):
    token: jax.Array        # [N] int32
    logprob: jax.Array      # [N] float32: log_softmax of the model's logits at the token
    top_tokens: jax.Array   # [N,K] int32, best first
    top_logprobs: jax.Array  # [N,K] float32


def pick(logits: jax.Array, rows: RowSampling, top: int) -> Picked:
    """logits: [N,V] float32 -> each row's token (argmax where temperature is 0, else drawn from the
    filtered, tempered logits with the row's own key) and the log-probabilities of the untempered logits."""
    greedy = rows.temperature <= 0
    filtered = filter_rows(logits, jnp.where(greedy, 1.0, rows.temperature), rows.top_k, rows.top_p)
    keys = jax.vmap(lambda seed, index: jax.random.fold_in(jax.random.key(seed), index))(rows.seed, rows.index)
    drawn = jax.vmap(jax.random.categorical)(keys, filtered)
    token = jnp.where(greedy, jnp.argmax(logits, axis=-1), drawn).astype(jnp.int32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    best, best_tokens = jax.lax.top_k(logp, top)
    return Picked(token, jnp.take_along_axis(logp, token[:, None], axis=-1)[:, 0], best_tokens.astype(jnp.int32), best)


def step_fn(graphdef, params, state: DecodeState, lengths: jax.Array, ids: jax.Array, counts: jax.Array,
            rows: RowSampling, *, top: int) -> tuple[DecodeState, Picked]:
    """lengths: [N] tokens each slot holds (the host's count, which also resets a reused slot);
    ids: [N,C]; counts: [N] (0: the slot sits this call out) -> the extended state and each row's
    pick after its last new token (meaningless where counts is 0). Unjitted: `engine_step` is it
    jitted with STEP_JIT; zaya_jax.engine.placement jits it with a mesh's shardings."""
    logits, state = extend(nnx.merge(graphdef, params), state._replace(lengths=lengths), ids, counts)
    return state, pick(logits, rows, top)


STEP_JIT = dict(static_argnums=(0,), static_argnames=("top",), donate_argnums=(2,))
engine_step = jax.jit(step_fn, **STEP_JIT)
