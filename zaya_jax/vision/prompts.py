"""Prompts with images, for generation: each prompt's images -> one padded ImageBatch row, and a
prompt's one-placeholder-per-image ids expanded to each image's tokens (as transformers' processor
expands `<|image_pad|>`).

  image_rows(images per prompt, model)  -> ImageBatch [B,P,F] (numpy), image tokens per prompt [B]
      P = the most patches of any prompt, rounded up to PATCH_BUCKET (similar images reuse the
      compiled tower); a prompt without images holds padding only
  expand_placeholders(ids, grids, ids_cfg)  each single `image` id -> its image's span
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from zaya_jax.errors import UserError
from zaya_jax.vision.layout import patch_layout
from zaya_jax.vision.model import ImageBatch, ImageTokenIds, ZayaVL
from zaya_jax.vision.processor import ImageProcessor

PATCH_BUCKET = 64


def image_rows(images: Sequence[Sequence], model: ZayaVL, processor: ImageProcessor | None = None
               ) -> tuple[ImageBatch, list[int], list[list[tuple[int, int, int]]]]:
    """images: per prompt, its images in the order of their placeholders (uint8 arrays or Pillow
    images) -> (ImageBatch of numpy [B,P,...], image tokens per prompt, grids per prompt)."""
    cfg = model.vision.config
    processor = processor or ImageProcessor.for_tower(cfg)
    done = [processor.batch(row) if len(row) else (np.zeros((0, cfg.patch_dim), np.float32), []) for row in images]
    most = max([len(patches) for patches, _ in done] + [1])
    pad = -(-most // PATCH_BUCKET) * PATCH_BUCKET
    rows, tokens = [], []
    for patches, grids in done:
        layout = patch_layout(grids, cfg, pad_to=pad) if grids else None
        if layout is None:
            rows.append((np.zeros((pad, cfg.patch_dim), np.float32), np.zeros((pad, 2), np.int32),
                         np.zeros(pad, np.int32), np.zeros(pad, np.int32)))
        else:
            rows.append((np.pad(patches, ((0, pad - len(patches)), (0, 0))), *layout[:3]))
        tokens.append(0 if layout is None else sum(layout.tokens_per_image))
    return ImageBatch(*(np.stack(parts) for parts in zip(*rows))), tokens, [grids for _, grids in done]


def expand_placeholders(ids: Sequence[int], grids: Sequence[Sequence[int]], token_ids: ImageTokenIds,
                        merge_size: int = 2) -> list[int]:
    """ids holding one `image` id per image (in order; a `vision_start` before it and a
    `vision_end` after it are kept, or added where missing) -> each replaced by its image's
    t*h*w / merge^2 placeholders."""
    ids = [int(i) for i in ids]
    where = [k for k, i in enumerate(ids) if i == token_ids.image]
    if len(where) != len(grids):
        raise UserError(f"the prompt holds {len(where)} image placeholders (token {token_ids.image}) for "
                        f"{len(grids)} images: put one placeholder where each image goes, in order")
    out, last = [], 0
    for k, (t, h, w) in zip(where, grids):
        out += ids[last:k]
        if not out or out[-1] != token_ids.vision_start:
            out.append(token_ids.vision_start)
        out += [token_ids.image] * (t * h * w // merge_size ** 2)
        if k + 1 >= len(ids) or ids[k + 1] != token_ids.vision_end:
            out.append(token_ids.vision_end)
        last = k + 1
    return out + ids[last:]
