"""Prompts with images, for generation: each prompt's images -> one padded ImageBatch row, and a
prompt's one-placeholder-per-image ids expanded to each image's tokens (as transformers' processor
expands `<|image_pad|>`).

  prompt_image_batch(images per prompt, model)  -> ImageBatch [B,P,F] (numpy), image tokens per prompt [B]
      P = the most patches of any prompt, rounded up to PATCH_BUCKET (similar images reuse the
      compiled tower); a prompt without images holds padding only
  expand_placeholders(ids, grids, ids_cfg)  each single `image` id -> its image's span
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from zaya_jax.data.vision.processor import ImageProcessor, image_span
from zaya_jax.errors import UserError
from zaya_jax.model.vision.layout import patch_row
from zaya_jax.model.vision.vl import ImageBatch, ImageTokenIds, ZayaVL

PATCH_BUCKET = 64


def prompt_image_batch(images: Sequence[Sequence], model: ZayaVL, processor: ImageProcessor | None = None
               ) -> tuple[ImageBatch, list[int]]:
    """images: per prompt, its images in the order of their placeholders (uint8 arrays or Pillow
    images) -> (ImageBatch of numpy [B,P,...], image tokens per prompt)."""
    cfg = model.vision.config
    processor = processor or ImageProcessor.for_tower(cfg)
    done = [processor.batch(row) if len(row) else (np.zeros((0, cfg.patch_dim), np.float32), []) for row in images]
    most = max([len(patches) for patches, _ in done] + [1])
    pad = -(-most // PATCH_BUCKET) * PATCH_BUCKET
    rows = [patch_row([p] if grids else [], grids, cfg, pad) for p, grids in done]
    tokens = [sum(t * h * w for t, h, w in grids) // cfg.merge_unit for _, grids in done]
    return ImageBatch(*(np.stack(parts) for parts in zip(*rows))), tokens


def expand_placeholders(ids: Sequence[int], grids: Sequence[Sequence[int]], token_ids: ImageTokenIds,
                        merge_size: int = 2, mask: Sequence[int] | None = None):
    """ids holding one `image` id per image (in order; a `vision_start` before it and a
    `vision_end` after it are kept, or added where missing) -> each replaced by its image's
    t*h*w / merge^2 placeholders; with `mask` (one value per id), -> (ids, mask) with 0 on the
    image spans."""
    ids = [int(i) for i in ids]
    values = [0] * len(ids) if mask is None else [int(m) for m in mask]
    where = [k for k, i in enumerate(ids) if i == token_ids.image]
    if len(where) != len(grids):
        raise UserError(f"the prompt holds {len(where)} image placeholders (token {token_ids.image}) for "
                        f"{len(grids)} images: put one placeholder where each image goes, in order")
    out, out_mask, last = [], [], 0
    for k, (t, h, w) in zip(where, grids):
        out, out_mask = out + ids[last:k], out_mask + values[last:k]
        span = image_span((t, h, w), *token_ids, merge_size)      # start, placeholders, end
        if out and out[-1] == token_ids.vision_start:
            span = span[1:]
        if k + 1 < len(ids) and ids[k + 1] == token_ids.vision_end:
            span = span[:-1]
        out, out_mask, last = out + span, out_mask + [0] * len(span), k + 1
    out, out_mask = out + ids[last:], out_mask + values[last:]
    return out if mask is None else (out, out_mask)
