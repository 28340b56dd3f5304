"""ZAYA1-VL: the vision tower in front of the ZAYA1 text model (transformers'
`Zaya1VLForConditionalGeneration`), composed, not forked: the text model is zaya_jax.model.zaya's.

  tokens = VisionTower(patches)                    [B,T,D]   T = P / 4 image tokens per example
  the k-th image placeholder of example b (input_ids == image_token_id, in order) takes tokens[b, k]
  logits = ZayaLM(input_ids, image_tokens=(placeholders, placed))   [B,S,V]
    (at the placeholders: the vision LoRA acts and attention is bidirectional among them;
     everywhere else the text model's computation, exactly)
An example's placeholders must number its images' tokens (zaya_jax.model.vision.layout's
tokens_per_image); `check_placeholders` says which example does not, on the host.
Text or vision-language is told apart in one place: `build_model` builds one of them from the
config, `is_vision_language(model)` says which it is, `text_model(model)` is its text decoder.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from zaya_jax.config import ModelConfig
from zaya_jax.errors import UserError
from zaya_jax.model.moe import MoEStats
from zaya_jax.model.vision.config import VisionConfig
from zaya_jax.model.vision.tower import VisionTower
from zaya_jax.model.zaya import ZayaLM


class ImageTokenIds(NamedTuple):
    """transformers' Zaya1VLConfig ids (ZAYA1-VL-8B's: ZAYA1_VL_IDS)."""
    image: int
    vision_start: int
    vision_end: int


ZAYA1_VL_IDS = ImageTokenIds(262147, 255999, 256000)


class ImageBatch(NamedTuple):
    """Each example's image patches, padded to P (zaya_jax.model.vision.layout, batched)."""
    patches: jax.Array          # [B,P,F]
    positions: jax.Array        # [B,P,2]
    image_segments: jax.Array   # [B,P]
    window_segments: jax.Array  # [B,P]


def place_image_tokens(input_ids: jax.Array, tokens: jax.Array, image_id: int) -> tuple[jax.Array, jax.Array]:
    """input_ids [B,S], tokens [B,T,D] -> (placeholder mask [B,S] bool, [B,S,D] with example b's k-th
    placeholder holding tokens[b, k]; zeros elsewhere)."""
    mask = input_ids == image_id
    index = jnp.clip(jnp.cumsum(mask, axis=1) - 1, 0, tokens.shape[1] - 1)
    placed = jnp.take_along_axis(tokens, index[..., None], axis=1)
    return mask, jnp.where(mask[..., None], placed, 0).astype(tokens.dtype)


def check_placeholders(input_ids: np.ndarray, tokens_per_example: Sequence[int], image_id: int) -> None:
    """Raises naming the first example whose placeholders do not number its image tokens."""
    counts = (np.asarray(input_ids) == image_id).sum(axis=1)
    for b, (have, want) in enumerate(zip(counts, tokens_per_example)):
        if have != want:
            raise UserError(f"example {b}: {have} image placeholders (token {image_id}) for {want} image tokens; "
                            "expand each image to its tokens with the image processor (data.vision.processor)")


def build_model(text: ModelConfig, vision: tuple[VisionConfig, ImageTokenIds] | None, *,
                rngs: nnx.Rngs) -> "ZayaLM | ZayaVL":
    """The model of a text config and an optional (tower, image token ids): a ZayaLM, or the ZayaVL around it."""
    return ZayaLM(text, rngs=rngs) if vision is None else ZayaVL(text, *vision, rngs=rngs)


def is_vision_language(model: "ZayaLM | ZayaVL") -> bool:
    """Whether `model` takes images (a ZayaVL: a tower, image token ids, the text model as .text);
    the one test of text vs vision-language that every caller makes."""
    return isinstance(model, ZayaVL)


def text_model(model: "ZayaLM | ZayaVL") -> ZayaLM:
    """The text decoder of `model`: a ZayaVL's .text, a ZayaLM itself."""
    return model.text if is_vision_language(model) else model


class ZayaVL(nnx.Module):
    def __init__(self, text: ModelConfig, vision: VisionConfig, ids: ImageTokenIds, *, rngs: nnx.Rngs):
        if vision.out_hidden_size != text.hidden_size:
            raise UserError(f"vision.out_hidden_size ({vision.out_hidden_size}) must equal the text model's "
                            f"hidden_size ({text.hidden_size})")
        self.vision = VisionTower(vision, remat=text.remat, rngs=rngs)
        self.text = ZayaLM(text, rngs=rngs)
        self.ids = ids

    def __call__(self, input_ids: jax.Array, images: ImageBatch | None = None, *,
                 segment_ids: jax.Array | None = None) -> jax.Array:
        """input_ids [B,S] -> logits [B,S,V] float32; images None: the text model alone."""
        return self.text.logits(self.hidden_states(input_ids, images, segment_ids=segment_ids)[0])

    def hidden_states(self, input_ids, images: ImageBatch | None = None, *, segment_ids=None, positions=None,
                      rope_theta=None) -> tuple[jax.Array, MoEStats]:
        """-> final-normed hidden [B,S,D] and router stats (ZayaLM.hidden_states', which reads
        segment_ids, positions and rope_theta)."""
        image_tokens = None
        if images is not None:
            tokens = self.vision(*images)
            image_tokens = place_image_tokens(input_ids, tokens, self.ids.image)
        return self.text.hidden_states(input_ids, segment_ids=segment_ids, positions=positions,
                                       rope_theta=rope_theta, image_tokens=image_tokens)
