"""Prefill, chunked extension and single-token decode of a ZayaLM over a DecodeState (zaya_jax.infer.cache).

Conventions: B sequences, S prompt width, T cache slots, D hidden, V vocab, L layers.
Both walk the same stacked layers as ZayaLM._run_layers (lax.scan, or a Python loop when
`scan_layers` is off) and run each layer's one step, DecoderLayer.step, with their cache view as its
`attend` and their row groups; what differs from the training forward:

  prefill      prompts right-padded to S, with per-sequence `lengths`. The padding comes after
               every real token, so causal attention, the convolutions and the value shift of
               real tokens never see it; it is the plain causal forward. Keys and values of all S
               slots go into the full layers' cache (slots past a sequence's length are hidden by
               the decode mask until decoding overwrites them), each sequence's last W into the
               sliding layers' ring buffers; the CCA carry is taken at each sequence's last real
               token.
               RoPE scaling that reads the sequence length (dynamic, longrope) takes the longest
               prompt, not the padded width S.
  extend       C tokens per sequence (counts [B] of them real) at positions `lengths`...: CCA
               continues from the carry; a full layer writes the keys and values into slots
               `lengths`... and attends to the slots holding positions 0..position; a sliding
               layer attends to its ring before the write and the chunk, within the window, then
               writes the last W positions (slot position % W); with both layer types, a lax.cond
               per layer picks its stack.
  decode_step  extend by one token per sequence.
               Both: when a chunk has no more tokens than there are experts, each token's expert
               weights are gathered (rows of integers, for a quantized model) instead of
               running the dispatch backend over every expert.
  all three    padding (prefill's past each length, extend's past each count) reaches no expert
               (MoE skip_masked): nothing reads its outputs, so a dropless backend computes the
               real tokens only, e.g. a prompt's last, short chunk or a slot sitting a call out.

On the native CPU grouped matmul (float weights, one device), prefill and extend read each
layer's experts in place from the stacked [L,E,K,N] weights (`stacked_experts_dispatch`): on CPU, XLA copies every
slice, and slicing a layer's experts out copies 3 x E x D x I weights per layer (bench_small:
48 MB per layer, more than the prefill's own work) and a gathered expert 3 x D x I per token.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from zaya_jax.infer.cache import (DecodeState, cache_index, chunk_attention, ring_from_prompt, ring_positions,
                                  ring_slots)
from zaya_jax.checkpoints.quantize import QuantizedWeight, rows
from zaya_jax.model import moe_dispatch
from zaya_jax.model.kernels import attention_fn, moe_dispatch_fn, resolve_moe_backend
from zaya_jax.model.layer_types import layer_flags, layer_kinds
from zaya_jax.model.moe import Gathered
from zaya_jax.model.moe_dispatch import ExpertWeights
from zaya_jax.native.grouped_matmul import grouped_matmul
from zaya_jax.parallel.context import active_axes, current_mesh_shape
from zaya_jax.parallel.rules import RULES
from zaya_jax.model.zaya import RowGroup, ZayaLM, join_groups


def _over_layers(body: Callable, carry, xs, num_layers: int, scan: bool):
    """lax.scan(body, carry, xs), or the same as a Python loop over layer slices."""
    if scan:
        return jax.lax.scan(body, carry, xs)
    outs = []
    for i in range(num_layers):
        carry, out = body(carry, jax.tree.map(lambda x, i=i: x[i], xs))
        outs.append(out)
    return carry, jax.tree.map(lambda *o: jnp.stack(o), *outs)


def _embed(model: ZayaLM, ids: jax.Array, image_tokens: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
    """ids: [B,S] -> the residual stream entering layer 0, [B,S,D]; image_tokens as prefill's."""
    emb = jnp.take(model.embed[...], ids, axis=0)
    if image_tokens is not None:
        emb = jnp.where(image_tokens[0][..., None], image_tokens[1].astype(emb.dtype), emb)
    stream_dtype = jnp.float32 if model.config.residual_in_fp32 else jnp.dtype(model.config.dtype)
    return ((emb + model.input_bias[...]) * model.input_scale[...]).astype(stream_dtype)


def stacked_experts_dispatch(model: ZayaLM, with_images: bool = False) -> Callable[[jax.Array], Callable] | None:
    """-> layer index [] -> a MoE dispatch (moe_dispatch's signature) whose grouped matmuls read
    that layer's experts in place from the stacked weights, viewed as [L*E,K,N] (a free reshape);
    the layer's own sliced expert weights then go unused and XLA drops them. None unless the MoE
    runs on the native CPU grouped matmul, on one device, with float (unquantized) weights, and
    (`with_images`: image tokens in the batch) no image token runs the experts' vision LoRA, E more
    experts the stacked weights lack."""
    cfg, moe = model.config, model.layers.moe
    stacked = (moe.gate, moe.up, moe.down)
    if (resolve_moe_backend(cfg.moe_backend) != "native" or any(n > 1 for n in current_mesh_shape().values())
            or any(isinstance(p.get_value(), QuantizedWeight) for p in stacked)
            or (with_images and moe.vision_lora is not None)):
        return None
    dtype = jnp.dtype(cfg.dtype)
    flat = ExpertWeights(*(p[...].reshape(-1, *p.shape[2:]).astype(dtype) for p in stacked))
    num_experts = moe.gate.shape[1]

    def for_layer(index: jax.Array) -> Callable:
        def dispatch(x, expert, _layer_weights):
            return moe_dispatch.ragged(x, expert, flat, matmul=grouped_matmul, num_experts=num_experts,
                                       first_group=index * num_experts)
        return dispatch
    return for_layer


def prefill(model: ZayaLM, ids: jax.Array, lengths: jax.Array, cache_size: int,
            image_tokens: tuple[jax.Array, jax.Array] | None = None) -> tuple[jax.Array, DecodeState]:
    """ids: [B,S] right-padded prompts; lengths: [B] (1 <= lengths <= S) ->
    logits at each sequence's last prompt token [B,V] float32 and the state of T = cache_size slots.

    image_tokens: ZAYA1-VL's (image mask [B,S] bool, features [B,S,D]) as ZayaLM.hidden_states takes
    them: the features replace those embeddings, the vision LoRA acts there and image positions see
    each other both ways. Decoded tokens are text, so decode_step needs none of it: the image
    positions' keys and values are in the cache."""
    cfg = model.config
    dtype = jnp.dtype(cfg.dtype)
    stream_dtype = jnp.float32 if cfg.residual_in_fp32 else dtype
    b, s = ids.shape
    image_mask = None if image_tokens is None else image_tokens[0]
    kinds = layer_kinds(cfg, jnp.broadcast_to(jnp.arange(s), (b, s)), attention_fn(cfg, bidirectional=image_mask),
                        seq_len=jnp.max(lengths))  # the longest prompt, not its padding (RoPE scaling's length)
    continues = jnp.broadcast_to(jnp.arange(s) > 0, (b, s))
    token_mask = jnp.arange(s)[None, :] < lengths[:, None]
    dispatch = moe_dispatch_fn(cfg)
    in_place = stacked_experts_dispatch(model, with_images=image_mask is not None)
    last = lengths - 1
    graphdef, layer_states = nnx.split(model.layers)

    def body(carry, xs):
        stream, router_state = carry
        layer_state, index, sliding = xs
        layer = nnx.merge(graphdef, layer_state)
        cos, sin, attention = kinds.for_layer(sliding)
        attend = lambda q, k, v, cache: (attention(q, k, v, None), cache)  # noqa: E731
        out = layer.step([RowGroup(stream, cos, sin, continues, attend)], router_state, None, token_mask=token_mask,
                         dispatch=dispatch if in_place is None else in_place(index), dtype=dtype,
                         stream_dtype=stream_dtype, skip_masked=True, image_mask=image_mask)
        (qkv,) = out.qkv
        return (out.streams[0], out.router_state), (qkv.k, qkv.v, jax.tree.map(lambda x: x[jnp.arange(b), last],
                                                                                   qkv.carry))

    router_state = jnp.zeros((b, s, cfg.router_hidden_size), jnp.float32)  # fp32 router
    (stream, _), (keys, values, carry) = _over_layers(body, (_embed(model, ids, image_tokens), router_state),
                                                      (layer_states, jnp.arange(cfg.num_layers), layer_flags(cfg)),
                                                      cfg.num_layers, cfg.scan_layers)
    sliding, slots = np.asarray(cfg.sliding_layers), ring_slots(cfg, cache_size)
    pad = [(0, 0), (0, 0), (0, cache_size - s), (0, 0), (0, 0)]
    full, ring = (lambda x: jnp.pad(x[~sliding], pad)), (lambda x: ring_from_prompt(x[sliding], lengths, slots))
    state = DecodeState(full(keys), full(values), ring(keys), ring(values), carry, lengths.astype(jnp.int32))
    hidden = model.final_norm(stream[jnp.arange(b), last], dtype)
    return model.logits(hidden), state


class Rows(NamedTuple):
    """One group of rows an `extend_rows` call continues: B of the state's N rows, C tokens each."""
    slots: jax.Array | None  # [B] distinct state rows, or None: all N in order
    ids: jax.Array           # [B,C] int
    counts: jax.Array        # [B] int in [0, C]: row b's first counts[b] ids are real (0: it sits the call out)


class _Geometry(NamedTuple):
    """Where a group's tokens sit and what each query sees (shapes as extend_rows')."""
    rows: jax.Array          # [B,1] state rows
    positions: jax.Array     # [B,C]
    valid: jax.Array         # [B,C] bool: real tokens
    continues: jax.Array     # [B,C] bool: position > 0 (CCA continues from the carry)
    kinds: object            # layer_kinds at these positions (their RoPE tables)
    full_visible: jax.Array  # [B,C,T] bool
    full_written: jax.Array  # [B,C] cache slot of each token (T: dropped)
    ring_visible: jax.Array  # [B,C,W+C] bool over [ring before the write ++ chunk]
    ring_written: jax.Array  # [B,C] ring slot (W: dropped)


def _geometry(cfg, group: Rows, lengths: jax.Array, slots: int, ring: int) -> _Geometry:
    """lengths: [B] tokens the group's rows hold; slots: T; ring: W."""
    b, c = group.ids.shape
    counts = group.counts.astype(jnp.int32)
    ends = lengths + counts
    offsets = jnp.arange(c)
    positions = lengths[:, None] + offsets
    valid = offsets[None, :] < counts[:, None]
    earliest = positions[:, :, None] - cfg.sliding_window                             # keys must be later
    ring_visible = jnp.concatenate([
        (ring_positions(lengths, ring)[:, None, :] > jnp.maximum(earliest, -1)),      # before the write
        (offsets[None, None, :] <= offsets[None, :, None]) & (positions[:, None, :] > earliest)], axis=2)
    rows = (jnp.arange(b) if group.slots is None else group.slots)[:, None]
    return _Geometry(rows, positions, valid, positions > 0, layer_kinds(cfg, positions, seq_len=jnp.max(ends)),
                     jnp.arange(slots)[None, None, :] <= positions[:, :, None], jnp.where(valid, positions, slots),
                     ring_visible,
                     jnp.where(valid & (positions >= ends[:, None] - ring), positions % max(ring, 1), ring))


def _rows_of(x: jax.Array, slots: jax.Array | None) -> jax.Array:
    """x: [N,...] -> the group's rows [B,...] (x itself for all N)."""
    return x if slots is None else x[slots]


def _batch_rows() -> int:
    """The product of the batch axes on the current mesh (1 without one)."""
    shape = current_mesh_shape()
    return math.prod(shape[a] for a in active_axes(RULES["batch"], shape)) if shape else 1


def extend_rows(model: ZayaLM, state: DecodeState, groups: Sequence[Rows]
                ) -> tuple[list[jax.Array], DecodeState]:
    """Each group's rows continue by its chunk, all in one pass over the layers -> each group's
    logits [B_g,V] float32 at its rows' last new tokens (meaningless where counts is 0) and the
    state holding the new tokens. A row may take tokens in one group only (counts 0 elsewhere).
    Slots must remain: lengths + counts <= T.

    Per layer each group runs its own CCA and attention (its rows gathered out of the state's N,
    its keys and values written back into them), and then one MoE runs over every group's tokens
    joined, so a prefill chunk and a decode step in one call read each layer's experts once (the
    serving engine's prefill-with-decode step, zaya_jax.engine.step). See `extend` for one group.
    """
    cfg = model.config
    dtype = jnp.dtype(cfg.dtype)
    stream_dtype = jnp.float32 if cfg.residual_in_fp32 else dtype
    counts = [g.counts.astype(jnp.int32) for g in groups]
    slots, ring = state.keys.shape[2], state.window_keys.shape[2]
    geometry = [_geometry(cfg, g, _rows_of(state.lengths, g.slots), slots, ring) for g in groups]
    batch_rows = _batch_rows()
    few_tokens = sum(g.ids.size for g in groups) <= cfg.num_experts
    dispatch = moe_dispatch_fn(cfg)
    gathered = Gathered(rows)
    in_place = stacked_experts_dispatch(model)
    graphdef, layer_states = nnx.split(model.layers)
    valid = join_groups([g.valid for g in geometry], batch_rows)
    kind_types = geometry[0].kinds.types

    def body(carry, xs):
        streams, router_state, caches = carry
        layer_state, index, prev, sliding, slot = xs
        layer = nnx.merge(graphdef, layer_state)
        row_groups = []
        for group, geo, stream in zip(groups, geometry, streams):
            cos, sin = geo.kinds.rope(sliding)
            prev_rows = jax.tree.map(lambda x: _rows_of(x, group.slots), prev)

            def attend(q, k, v, caches, windowed: bool, geo=geo, group=group):
                keys, values = caches[2:] if windowed else caches[:2]
                if windowed:
                    o = chunk_attention(q, jnp.concatenate([_rows_of(keys[slot], group.slots), k], axis=1),
                                        jnp.concatenate([_rows_of(values[slot], group.slots), v], axis=1),
                                        geo.ring_visible)
                written = geo.ring_written if windowed else geo.full_written
                keys = keys.at[slot, geo.rows, written].set(k, mode="drop")
                values = values.at[slot, geo.rows, written].set(v, mode="drop")
                if not windowed:
                    o = chunk_attention(q, _rows_of(keys[slot], group.slots), _rows_of(values[slot], group.slots),
                                        geo.full_visible)
                return o, ((*caches[:2], keys, values) if windowed else (keys, values, *caches[2:]))
            if len(kind_types) == 2:
                def either(q, k, v, caches, attend=attend):
                    return jax.lax.cond(sliding, lambda c: attend(q, k, v, c, windowed=True),
                                        lambda c: attend(q, k, v, c, windowed=False), caches)
                group_attend = either
            else:
                group_attend = functools.partial(attend, windowed=True in kind_types)
            row_groups.append(RowGroup(stream, cos, sin, geo.continues, group_attend, prev_rows))
        moe_dispatch_now = in_place(index) if in_place is not None else gathered if few_tokens else dispatch
        out = layer.step(row_groups, router_state, caches, token_mask=valid, dispatch=moe_dispatch_now, dtype=dtype,
                         stream_dtype=stream_dtype, rows=batch_rows, skip_masked=True)
        carry_out = jax.tree.map(jnp.asarray, prev)
        for geo, count, qkv, row_group in zip(geometry, counts, out.qkv, row_groups):
            took = (count > 0).reshape(-1, *([1] * (row_group.prev[0].ndim - 1)))
            carry_out = jax.tree.map(
                lambda out, n, p: out.at[geo.rows[:, 0]].set(jnp.where(took, at_last(n, p, count), out[geo.rows[:, 0]])),
                carry_out, qkv.carry, row_group.prev)
        return (tuple(out.streams), out.router_state, out.cache), carry_out

    init = (tuple(_embed(model, g.ids) for g in groups),
            jnp.zeros((*valid.shape, cfg.router_hidden_size), jnp.float32),
            (state.keys, state.values, state.window_keys, state.window_values))
    xs = (layer_states, jnp.arange(cfg.num_layers), state.carry, layer_flags(cfg), jnp.asarray(cache_index(cfg)))
    (streams, _, caches), carry = _over_layers(body, init, xs, cfg.num_layers, cfg.scan_layers)
    lengths = jnp.asarray(state.lengths)
    for geo, count in zip(geometry, counts):
        lengths = lengths.at[geo.rows[:, 0]].add(count)
    logits = [model.logits(model.final_norm(stream[jnp.arange(stream.shape[0]), jnp.maximum(count - 1, 0)], dtype))
              for stream, count in zip(streams, counts)]
    return logits, DecodeState(*caches, carry, lengths)


def extend(model: ZayaLM, state: DecodeState, ids: jax.Array, counts: jax.Array) -> tuple[jax.Array, DecodeState]:
    """ids: [B,C] int; counts: [B] int in [0, C]: row b's first counts[b] tokens go at positions
    state.lengths[b] + 0..counts[b]-1 (the rest is padding) -> logits [B,V] float32 at each row's
    last new token (rows with counts 0: meaningless) and the state holding the new tokens
    (lengths + counts; rows with counts 0 unchanged). Slots must remain: lengths + counts <= T.

    A chunked prefill that continues a state, and with C = 1 the decode step. CCA continues from
    the carry (a row at length 0 starts its sequence). A full layer writes the chunk's keys and
    values into their slots, then its queries read slots 0..position. A sliding layer's queries
    read [the ring before the write ++ the chunk] (the write could overwrite a ring key an earlier
    query of the chunk still sees), each key visible within the window; then the last W new
    positions are written into the ring (earlier ones would be overwritten by later ones of the
    same chunk: a scatter with repeated slots has no defined winner). `extend_rows` with one
    group of all B rows.
    """
    (logits,), state = extend_rows(model, state, [Rows(None, ids, counts)])
    return logits, state


def at_last(per_token: jax.Array, before: jax.Array, counts: jax.Array) -> jax.Array:
    """per_token: [B,C,...]; before: [B,...]; counts: [B] -> [B,...]: row b's entry at counts[b] - 1,
    or `before` where counts[b] is 0."""
    b = per_token.shape[0]
    last = per_token[jnp.arange(b), jnp.maximum(counts - 1, 0)]
    return jnp.where((counts > 0).reshape((b,) + (1,) * (last.ndim - 1)), last, before)


def decode_step(model: ZayaLM, state: DecodeState, tokens: jax.Array) -> tuple[jax.Array, DecodeState]:
    """tokens: [B] int, one per sequence, at positions state.lengths -> logits [B,V] float32 and
    the state holding them (lengths + 1): `extend` by one token. Slots must remain: state.lengths < T."""
    return extend(model, state, tokens[:, None], jnp.ones_like(state.lengths))
