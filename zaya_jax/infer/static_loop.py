"""generate_static(): prompts in, new token ids out, in one static batch (the static loop).

One jitted prefill over the right-padded prompts, then one jitted `lax.while_loop` that feeds
each sampled token back through `decode_step` with a static cache of
T = prompt width + max_new_tokens - 1 slots. Prompt widths are rounded up to a multiple of
PROMPT_BUCKET so that similar prompts reuse the compiled programs.

    new = generate_static(model, [[2, 17, 5], [2, 9]], max_new_tokens=32)   # [2, 32] int32

The library's `generate` (zaya_jax.engine.generate) runs this loop unless asked for the engine's
slots; call that one.

A ZAYA1-VL model (zaya_jax.model.vision.vl.ZayaVL) takes `images`, each prompt's images in the order
of its placeholders: the prefill runs the vision tower and places its tokens (zaya_jax.data.vision.prompts
builds the padded patch rows), then the text model decodes from the cache as without images.

With `mesh` (a mesh with a `data` axis), the rows, their caches and their new tokens are split
over `data` and the weights replicated: every row's tokens are those of one device (rows never
mix, and jax's partitionable random bits do not depend on the sharding).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import io_callback

from zaya_jax.data.vision.processor import ImageProcessor
from zaya_jax.data.vision.prompts import prompt_image_batch
from zaya_jax.errors import UserError
from zaya_jax.infer.cache import DecodeState
from zaya_jax.infer.decode import decode_step, prefill
from zaya_jax.infer.sampling import Sampler, sample
from zaya_jax.model.vision.vl import (ImageBatch, ZayaVL, check_placeholders, is_vision_language, place_image_tokens,
                                      text_model)
from zaya_jax.model.zaya import ZayaLM

PROMPT_BUCKET = 16
_listeners: dict[int, Callable] = {}  # on_token hooks of running generate_static calls, by id
_listener_ids = itertools.count()


def _deliver(listener, step, tokens) -> None:
    _listeners[int(listener)](step, tokens)


def pad_prompts(prompt_ids, lengths: Sequence[int] | None, pad_id: int, vocab_size: int
                ) -> tuple[np.ndarray, np.ndarray]:
    """-> ids [B, S] int32 right-padded with pad_id (S a multiple of PROMPT_BUCKET), lengths [B].

    prompt_ids: a list of token-id lists of any lengths, one flat list of ids (one prompt), or
    an int array [B, S] of right-padded prompts whose real lengths are `lengths` (default S).
    """
    if isinstance(prompt_ids, (list, tuple)) and prompt_ids and all(np.ndim(p) == 0 for p in prompt_ids):
        prompt_ids = [prompt_ids]
    if isinstance(prompt_ids, (list, tuple)):
        if lengths is not None:
            raise ValueError("lengths is only for a padded [B, S] array; a list of lists carries its own")
        rows = [np.asarray(p, np.int64).reshape(-1) for p in prompt_ids]
        lengths = [len(r) for r in rows]
    else:
        array = np.asarray(prompt_ids)
        if array.ndim != 2 or not np.issubdtype(array.dtype, np.integer):
            raise ValueError(f"prompt_ids must be a list of id lists or an int array [B, S]; got "
                             f"{array.dtype} {array.shape}")
        lengths = [array.shape[1]] * array.shape[0] if lengths is None else [int(n) for n in lengths]
        if len(lengths) != array.shape[0] or max(lengths) > array.shape[1]:
            raise ValueError(f"lengths {lengths} do not fit prompt_ids of shape {array.shape}")
        rows = [array[i, :n] for i, n in enumerate(lengths)]
    if not rows or min(lengths) < 1:
        raise ValueError("every prompt needs at least one token")
    for i, r in enumerate(rows):
        if r.min() < 0 or r.max() >= vocab_size:
            raise ValueError(f"prompt {i} holds ids outside the vocabulary [0, {vocab_size})")
    width = -(-max(lengths) // PROMPT_BUCKET) * PROMPT_BUCKET
    ids = np.full((len(rows), width), pad_id, np.int32)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = r
    return ids, np.asarray(lengths, np.int32)


@functools.partial(jax.jit, static_argnums=(0, 4))
def _prefill(graphdef, params, ids, lengths, cache_size: int, images: ImageBatch | None = None
             ) -> tuple[jax.Array, DecodeState]:
    model = nnx.merge(graphdef, params)
    if images is None:
        return prefill(text_model(model), ids, lengths, cache_size)
    with jax.named_scope("vision_tower"):
        tokens = model.vision(*images)
    return prefill(model.text, ids, lengths, cache_size, place_image_tokens(ids, tokens, model.ids.image))


@functools.partial(jax.jit, static_argnums=(0,),
                   static_argnames=("max_new_tokens", "sampler", "stop_ids", "pad_id", "stream"))
def _decode(graphdef, params, state: DecodeState, logits: jax.Array, key: jax.Array, listener: jax.Array, *,
            max_new_tokens: int, sampler: Sampler, stop_ids: tuple[int, ...], pad_id: int, stream: bool) -> jax.Array:
    """logits: [B,V] of the last prompt tokens -> new tokens [B, max_new_tokens] int32.

    With `stream`, every new column goes to the host hook registered as `listener` (a traced id,
    so any hook reuses the compiled loop)."""
    model = text_model(nnx.merge(graphdef, params))
    b = logits.shape[0]

    def emit(step, tokens):
        if stream:
            io_callback(_deliver, None, listener, step, tokens, ordered=True)

    first = sample(logits, jax.random.fold_in(key, 0), sampler)
    emit(0, first)
    tokens = jnp.full((b, max_new_tokens), pad_id, jnp.int32).at[:, 0].set(first)
    stops = jnp.asarray(stop_ids, jnp.int32)
    done = jnp.isin(first, stops)

    def cond(carry):
        step, _, _, done = carry
        return (step < max_new_tokens) & ~jnp.all(done)

    def body(carry):
        step, tokens, state, done = carry
        logits, state = decode_step(model, state, tokens[:, step - 1])
        new = jnp.where(done, pad_id, sample(logits, jax.random.fold_in(key, step), sampler))
        emit(step, new)
        done = done | jnp.isin(new, stops)
        return step + 1, tokens.at[:, step].set(new), state, done

    return jax.lax.while_loop(cond, body, (jnp.int32(1), tokens, state, done))[1]


def new_token_room(prompt_length: int, context: int) -> int:
    """The most new tokens a prompt of `prompt_length` tokens may ask for in `context` positions:
    context - prompt_length + 1, as the last new token is never fed back (prompt + new - 1 <= context).
    Below 1: the prompt itself is too long for one new token. The one rule of generate, its CLI, the
    engine and the server."""
    return context - prompt_length + 1


def stop_tokens(eos_id: int, stop_ids: Sequence[int] = (), stop_at_eos: bool = True) -> tuple[int, ...]:
    """The ids that end a sequence: eos and `stop_ids` (sorted, once each); none unless stop_at_eos."""
    return tuple(sorted({int(eos_id), *map(int, stop_ids)})) if stop_at_eos else ()


def generate_static(model: ZayaLM | ZayaVL, prompt_ids, max_new_tokens: int, *, temperature: float = 0.0,
                    top_k: int | None = None, top_p: float | None = None, seed: int = 0,
                    lengths: Sequence[int] | None = None, stop_at_eos: bool = True, stop_ids: Sequence[int] = (),
                    on_token: Callable[[np.ndarray, np.ndarray], None] | None = None,
                    mesh: jax.sharding.Mesh | None = None, images: Sequence[Sequence] | None = None,
                    image_processor: ImageProcessor | None = None) -> np.ndarray:
    """Generates up to `max_new_tokens` tokens after each prompt -> int32 [B, max_new_tokens].

    prompt_ids: a list of token-id lists (any lengths; a flat list is one prompt), or an int
      array [B, S] of right-padded prompts with their real `lengths` [B] (default: all S).
    temperature, top_k, top_p: 0 is greedy; otherwise see zaya_jax.infer.sampling. The random
      stream is fixed by `seed`.
    stop_at_eos: once a sequence emits model.config.eos_token_id (kept in the output), its later
      slots hold pad_token_id; decoding ends when every sequence has stopped.
    stop_ids: more ids that end a sequence as eos does (a chat template's end of turn,
      chat_template.end_of_turn_ids); like eos, ignored when stop_at_eos is False.
    on_token(step, tokens [B]): called from inside the compiled loop, in order, for each new
      column (a streaming hook); every generate_static call with a hook shares one compiled loop.
    mesh: split the B rows over its `data` axis (B must divide by its size), weights replicated.
    images: for a ZayaVL, per prompt a list of its images (uint8 [H, W(, C)] arrays or Pillow
      images; the list may be empty), in the order of its placeholders; the prompt holds each
      image's expanded span (zaya_jax.data.vision.prompts.expand_placeholders). The images' patches are
      padded to a multiple of zaya_jax.data.vision.prompts.PATCH_BUCKET. image_processor: how they are
      resized and cut (default: ImageProcessor.for_tower(model.vision.config), Qwen2-VL's sizes).
    """
    cfg = text_model(model).config
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    sampler = Sampler(float(temperature), top_k, top_p).validate(cfg.vocab_size)
    ids, lengths = pad_prompts(prompt_ids, lengths, cfg.pad_token_id, cfg.vocab_size)
    image_batch = prompt_images(model, ids, images, image_processor)
    if cfg.position_limit is not None and max_new_tokens > new_token_room(int(lengths.max()), cfg.position_limit):
        raise ValueError(f"prompt ({int(lengths.max())} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
                         f"model.max_position_embeddings={cfg.max_position_embeddings}")
    graphdef, params = nnx.split(model)
    ids, lengths = jnp.asarray(ids), jnp.asarray(lengths)
    with contextlib.ExitStack() as placed:
        if mesh is not None:
            ids, lengths, params, image_batch = split_rows(mesh, ids, lengths, params, image_batch)
            placed.enter_context(jax.set_mesh(mesh))
        logits, state = _prefill(graphdef, params, ids, lengths, ids.shape[1] + max_new_tokens - 1, image_batch)
        listener = next(_listener_ids)
        if on_token is not None:
            _listeners[listener] = on_token
        try:
            tokens = _decode(graphdef, params, state, logits, jax.random.key(seed), jnp.int32(listener),
                             max_new_tokens=max_new_tokens, sampler=sampler,
                             stop_ids=stop_tokens(cfg.eos_token_id, stop_ids, stop_at_eos), pad_id=cfg.pad_token_id,
                             stream=on_token is not None)
            tokens = np.asarray(tokens)
            if on_token is not None:
                jax.effects_barrier()  # every hook call has run
        finally:
            _listeners.pop(listener, None)
    return tokens


def prompt_images(model: ZayaLM | ZayaVL, ids: np.ndarray, images: Sequence[Sequence] | None,
                  processor: ImageProcessor | None = None) -> ImageBatch | None:
    """Each prompt's images as one padded ImageBatch row (None without images), after checking that
    each prompt's placeholders number its images' tokens."""
    image_id = model.ids.image if is_vision_language(model) else None
    if images is None:
        if image_id is not None and (ids == image_id).any():
            raise UserError(f"the prompts hold image placeholders (token {image_id}) but no images were given")
        return None
    if image_id is None:
        raise UserError("images need a vision-language model (a ZayaVL: zaya_jax.checkpoints.hf_vl.load_vl_hf); "
                        "this one is text only")
    if len(images) != ids.shape[0]:
        raise UserError(f"images: {len(images)} lists for {ids.shape[0]} prompts; give one (maybe empty) per prompt")
    batch, tokens = prompt_image_batch(images, model, processor)
    check_placeholders(ids, tokens, image_id)
    return ImageBatch(*map(jnp.asarray, batch))


def split_rows(mesh: jax.sharding.Mesh, ids: jax.Array, lengths: jax.Array, params, images: ImageBatch | None):
    """ids [B, S], lengths [B] and images [B, P, ...] split over the mesh's `data` axis, params
    replicated on it."""
    ranks = mesh.shape.get("data", 1)
    if ids.shape[0] % ranks:
        raise ValueError(f"{ids.shape[0]} prompts do not split over the mesh's data axis of {ranks}; pass a "
                         f"multiple of {ranks} prompts (repeat the last one)")
    rows = jax.sharding.NamedSharding(mesh, jax.P("data"))
    return (jax.device_put(ids, rows), jax.device_put(lengths, rows),
            jax.device_put(params, jax.sharding.NamedSharding(mesh, jax.P())), jax.device_put(images, rows))
