"""Requests with images (ZAYA1-VL): each prefilled whole, alone, by one compiled call that also runs
the vision tower, and its state row written into the request's slot.

Shapes: N slots of T = cache_size positions, S = the prompt's width (its length rounded up to a
multiple of generate's PROMPT_BUCKET, at most T), P = its images' patches (rounded up to a multiple
of PATCH_BUCKET), F patch features, K = max_top_logprobs, V vocab.

Image positions attend to each other both ways and the vision LoRA acts on them, so an image is
never cut across the engine's prefill chunks: `prefill_with_images` is generate's own prefill (the
same padded ids and ImageBatch as `generate` of that request alone builds), at batch 1,
written into row `slot` of the engine's donated [N,T] state; the request then decodes among the
others as text (its image positions' keys and values are in the cache). One compilation per
(S, P) bucket pair that requests use.

On a mesh (zaya_jax.engine.placement) the MoE splits a call's rows over the batch axes, so the
request's row is repeated to m = their product (`copies`, the engine's smallest row bucket) and
row 0 is kept: the copies compute the same function of the same inputs.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from zaya_jax.data.vision.processor import ImageProcessor
from zaya_jax.engine.step import Picked, RowSampling, pick
from zaya_jax.infer.cache import DecodeState
from zaya_jax.infer.decode import prefill
from zaya_jax.infer.static_loop import pad_prompts, prompt_images
from zaya_jax.model.vision.vl import ImageBatch, ZayaVL, place_image_tokens


def image_inputs(model: ZayaVL, prompt: np.ndarray, images: Sequence | None, processor: ImageProcessor,
                 cache_size: int) -> tuple[np.ndarray, ImageBatch | None]:
    """One request's prompt [n] and images (uint8 [H, W(, C)] arrays or Pillow images, in the order
    of its placeholder spans) -> (ids [1,S] right-padded, its ImageBatch [1,P,...]); None for the
    batch when it has no images (then the prompt must hold no placeholders). UserError when the
    placeholders do not number the images' tokens; as generate's checks."""
    ids, _ = pad_prompts([prompt.tolist()], None, model.text.config.pad_token_id, model.text.config.vocab_size)
    batch = prompt_images(model, ids, [list(images)] if images else None, processor)
    return ids[:, :cache_size], batch


def vision_split(model: ZayaVL) -> tuple[nnx.GraphDef, nnx.State]:
    """A ZayaVL -> (its graphdef, its state without the text model's: the vision tower), to merge
    with the engine's text params (its own placed copy) in `prefill_with_images_fn`."""
    graphdef, tower, _ = nnx.split(model, lambda path, _: path[0] != "text", ...)
    return graphdef, tower


def prefill_with_images_fn(graphdef, vision_params, text_params, state: DecodeState, slot: jax.Array, ids: jax.Array,
                           length: jax.Array, images: ImageBatch, rows: RowSampling, *, top: int,
                           copies: int) -> tuple[DecodeState, Picked]:
    """graphdef/vision_params: vision_split of a ZayaVL; text_params: its text model's; state: the
    engine's [N,T] state (donated); slot: [] int32; ids: [1,S] right-padded prompt; length: [1] its
    tokens; images: [1,P,...]; rows: one row's sampling ([1] arrays); copies: m, rows computed (the
    row repeated) -> the state with row `slot` holding the prompt (every other row unchanged) and
    the pick [1] after its last token. Unjitted: `prefill_with_images` is it jitted with IMAGES_JIT;
    zaya_jax.engine.placement jits it with a mesh's shardings."""
    model = nnx.merge(graphdef, vision_params, nnx.State({"text": text_params}))
    ids, length, images = jax.tree.map(lambda x: jnp.repeat(x, copies, axis=0), (ids, length, images))
    with jax.named_scope("vision_tower"):
        tokens = model.vision(*images)
    logits, row = prefill(model.text, ids, length, state.keys.shape[2],
                          place_image_tokens(ids, tokens, model.ids.image))
    per_layer = [(s, r) for s, r in zip(jax.tree.leaves(state[:5]), jax.tree.leaves(row[:5]))]
    placed = [s.at[:, slot].set(r[:, 0].astype(s.dtype)) for s, r in per_layer]
    lengths = state.lengths.at[slot].set(length[0])
    return jax.tree.unflatten(jax.tree.structure(state), placed + [lengths]), pick(logits[:1], rows, top)


IMAGES_JIT = dict(static_argnums=(0,), static_argnames=("top", "copies"), donate_argnums=(3,))
prefill_with_images = jax.jit(prefill_with_images_fn, **IMAGES_JIT)


def fill_test_image(height: int, width: int) -> np.ndarray:
    """A uint8 [height, width, 3] grey image (warm-up's stand-in for a real one of that size)."""
    return np.full((height, width, 3), 128, np.uint8)
