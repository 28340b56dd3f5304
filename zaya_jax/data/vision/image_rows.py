"""Packed training rows of conversations with images (records.ImageChatDocument): the
packing.RowFormat of image_chat data.

A piece is a whole conversation: its image spans are never cut, so each row's placeholders are
exactly its images' tokens, in order. A conversation longer than L + 1 tokens, or with more patches
than a row holds (`patch_capacity`), yields no piece (it is left out, as a chat document with no
target would be). A row is packing.make_row's [L] arrays over the conversations' (ids, mask), plus
its images' patches, made here from the stored pixels by the vision processor (normalise, cut):

  patches          float32 [P, F]   the row's images' patches in order, then zeros
  patch_positions  int32   [P, 2]   zaya_jax.model.vision.layout's, group 0 on padding
  image_segments   int32   [P]
  window_segments  int32   [P]
with P = patch_capacity; batched [B, P, ...], they are the ImageBatch ZayaVL takes.
With `augment` (vision.augment.ImageAugment), the documents a training lane draws have their images
augmented (training_document); held-out rows are the stored images.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from zaya_jax.data import packing
from zaya_jax.data.records import ImageChatDocument
from zaya_jax.data.vision.augment import ImageAugment
from zaya_jax.data.vision.processor import ImageProcessor
from zaya_jax.model.vision.config import VisionConfig
from zaya_jax.model.vision.layout import patch_row

IMAGE_KEYS = ("patches", "patch_positions", "image_segments", "window_segments")


class ImageChatRows:
    """The RowFormat of image_chat documents for a tower `vision` and rows of `patch_capacity` patches,
    training images augmented by `augment` (None: as stored)."""

    def __init__(self, vision: VisionConfig, patch_capacity: int, augment: ImageAugment | None = None):
        if patch_capacity <= 0 or patch_capacity % vision.merge_unit:
            raise ValueError(f"patch_capacity must be a positive multiple of {vision.merge_unit}, got {patch_capacity}")
        self.vision, self.patch_capacity, self.augment = vision, patch_capacity, augment or ImageAugment()
        self.processor = ImageProcessor.for_tower(vision)

    def training_document(self, doc: ImageChatDocument, seed: int) -> ImageChatDocument:
        return self.augment.document(doc, seed)

    def piece_patches(self, doc: ImageChatDocument) -> int:
        p = self.vision.patch_size
        return sum(image.shape[0] // p * (image.shape[1] // p) for image in doc.images)

    def document_positions(self, doc: ImageChatDocument, seq_len: int) -> int:
        n = doc.tokens.shape[1]
        return n - 1 if 2 <= n <= seq_len + 1 and self.piece_patches(doc) <= self.patch_capacity else 0

    @staticmethod
    def next_piece(doc: ImageChatDocument, start: int, seq_len: int) -> tuple[ImageChatDocument, None]:
        del start, seq_len  # a conversation is one piece
        return doc, None

    @staticmethod
    def piece_positions(doc: ImageChatDocument) -> int:
        return doc.tokens.shape[1] - 1

    def make_row(self, docs: Sequence[ImageChatDocument], seq_len: int, pad_id: int) -> dict[str, np.ndarray]:
        row = packing.make_row([doc.tokens for doc in docs], seq_len, pad_id)
        cut = [self.processor.patches(image) for doc in docs for image in doc.images]
        arrays = patch_row([p for p, _ in cut], [grid for _, grid in cut], self.vision, self.patch_capacity)
        return row | dict(zip(IMAGE_KEYS, arrays))
