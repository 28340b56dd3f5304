"""The engine's compiled calls: a prefill chunk for the prefilling rows with one decode step of
the others in the same pass, and a block of decode steps.

Shapes: N slots, B rows in a chunk call (a bucket of Engine.row_buckets: B = N, or the prefilling
slots and others gathered), C tokens per row (the prefill chunk), V vocab, K = max_top_logprobs,
k = the most decode steps in one call, S = STOP_IDS. Each (B, C, K) is one compilation of
`engine_chunk`, each (N, K, k) one of `engine_decode`. The state is donated: a call updates the
engine's cache in place instead of copying it.

`pick` skips what no row of the call needs: the top-k / top-p filter and the draw when every row
is greedy, the best-K search when no row reports top logprobs (each a `lax.cond`, so the program
branches at run time instead of computing and discarding).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from zaya_jax.infer.cache import DecodeState
from zaya_jax.infer.decode import Rows, extend, extend_rows
from zaya_jax.infer.sampling import filter_rows

STOP_IDS = 8  # S: stop ids per row checked on the device (a row with more is decoded one step per call)


class RowSampling(NamedTuple):
    """Each row's settings, [N] arrays: temperature (0: greedy), top_k (V: off), top_p (1: off),
    seed, the index of the token being chosen (its random key: fold_in(key(seed), index)) and
    top_logprobs, how many best tokens the row reports (0: none)."""
    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    seed: jax.Array
    index: jax.Array
    top_logprobs: jax.Array


class Picked(NamedTuple):
    token: jax.Array        # [N] int32
    logprob: jax.Array      # [N] float32: log_softmax of the model's logits at the token
    top_tokens: jax.Array   # [N,K] int32, best first (zeros when no row of the call reports top logprobs)
    top_logprobs: jax.Array  # [N,K] float32


def pick(logits: jax.Array, rows: RowSampling, top: int) -> Picked:
    """logits: [N,V] float32 -> each row's token (argmax where temperature is 0, else drawn from the
    filtered, tempered logits with the row's own key) and the log-probabilities of the untempered logits."""
    greedy = rows.temperature <= 0
    argmax = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def drawn(logits):
        filtered = filter_rows(logits, jnp.where(greedy, 1.0, rows.temperature), rows.top_k, rows.top_p)
        keys = jax.vmap(lambda seed, index: jax.random.fold_in(jax.random.key(seed), index))(rows.seed, rows.index)
        return jnp.where(greedy, argmax, jax.vmap(jax.random.categorical)(keys, filtered).astype(jnp.int32))
    token = jax.lax.cond(jnp.all(greedy), lambda _: argmax, drawn, logits)
    logp = jax.nn.log_softmax(logits, axis=-1)

    def best(logp):
        values, tokens = jax.lax.top_k(logp, top)
        return tokens.astype(jnp.int32), values
    nothing = lambda logp: (jnp.zeros((logp.shape[0], top), jnp.int32), jnp.zeros((logp.shape[0], top), logp.dtype))  # noqa: E731
    top_tokens, top_logprobs = jax.lax.cond(jnp.any(rows.top_logprobs > 0), best, nothing, logp)
    return Picked(token, jnp.take_along_axis(logp, token[:, None], axis=-1)[:, 0], top_tokens, top_logprobs)


def chunk_fn(graphdef, params, state: DecodeState, slots: jax.Array | None, lengths: jax.Array, ids: jax.Array,
             counts: jax.Array, rows: RowSampling, feed: jax.Array, feeding: jax.Array, feed_rows: RowSampling, *,
             top: int) -> tuple[DecodeState, Picked, Picked]:
    """A prefill chunk and a decode step in one pass (infer.decode.extend_rows: each layer's
    experts read once for both). slots: [B] distinct slot indices the chunk extends (gathered out
    of the [N] state and written back), or None for all N in order; lengths: [N] tokens each slot
    holds (the host's count, which also resets a reused slot); ids: [B,C]; counts: [B] (0: the row
    sits the chunk out); rows: the chunk rows' sampling; feed: [N] each slot's last token, decoded
    where feeding [N] is 1 (a slot takes tokens in one of the two only); feed_rows: [N] their
    sampling -> the state, each chunk row's pick after its last new token and each slot's decoded
    pick (meaningless where counts or feeding is 0). Unjitted: `engine_chunk` is it jitted with
    CHUNK_JIT; zaya_jax.engine.placement jits it with a mesh's shardings."""
    model = nnx.merge(graphdef, params)
    (decoded, chunked), state = extend_rows(model, state._replace(lengths=lengths),
                                            [Rows(None, feed[:, None], feeding), Rows(slots, ids, counts)])
    return state, pick(chunked, rows, top), pick(decoded, feed_rows, top)


class Decoded(NamedTuple):
    """A block of decode steps: step i's Picked in row i of each [k,N,...] array (rows past a
    slot's `made` are meaningless)."""
    picked: Picked          # [k,N], [k,N], [k,N,K], [k,N,K]
    made: jax.Array         # [N] int32: tokens each slot made


def decode_fn(graphdef, params, state: DecodeState, lengths: jax.Array, tokens: jax.Array, budget: jax.Array,
              stop_ids: jax.Array, rows: RowSampling, steps: jax.Array, *, top: int,
              block: int) -> tuple[DecodeState, Decoded]:
    """Up to `steps` (<= k = `block`) decode steps in one call. lengths: [N] tokens each slot holds;
    tokens: [N] each slot's last token (fed first); budget: [N] tokens each slot may make in this
    call (0: idle); stop_ids: [N,S] ids that end a slot's response (-1: none); rows: sampling at
    the block's first token (step i chooses token index + i) -> the state and the Decoded block.
    Each step is the one-token `extend` and `pick` of every slot still going (the others sit it
    out: counts 0); a slot stops after a stop id or its budget; the loop ends when every slot has
    stopped or after `steps`. Unjitted: `engine_decode` is it jitted with DECODE_JIT."""
    model = nnx.merge(graphdef, params)
    n = tokens.shape[0]
    out = Picked(jnp.zeros((block, n), jnp.int32), jnp.zeros((block, n), jnp.float32),
                 jnp.zeros((block, n, top), jnp.int32), jnp.zeros((block, n, top), jnp.float32))

    def going(carry):
        i, _, _, made, active, _ = carry
        return (i < steps) & jnp.any(active)

    def one_step(carry):
        i, state, feed, made, active, out = carry
        logits, state = extend(model, state, feed[:, None], active.astype(jnp.int32))
        picked = pick(logits, rows._replace(index=rows.index + i), top)
        out = jax.tree.map(lambda o, p: jax.lax.dynamic_update_index_in_dim(o, p, i, 0), out, picked)
        made = made + active
        active = active & (made < budget) & ~jnp.any(picked.token[:, None] == stop_ids, axis=-1)
        return i + 1, state, jnp.where(active, picked.token, feed), made, active, out
    start = (jnp.int32(0), state._replace(lengths=lengths), tokens, jnp.zeros_like(budget), budget > 0, out)
    _, state, _, made, _, out = jax.lax.while_loop(going, one_step, start)
    return state, Decoded(out, made)


CHUNK_JIT = dict(static_argnums=(0,), static_argnames=("top",), donate_argnums=(2,))
DECODE_JIT = dict(static_argnums=(0,), static_argnames=("top", "block"), donate_argnums=(2,))
engine_chunk = jax.jit(chunk_fn, **CHUNK_JIT)
engine_decode = jax.jit(decode_fn, **DECODE_JIT)
