"""Images -> patches and placeholders, as Qwen2-VL's image processor does (transformers'
`Qwen2VLImageProcessorPil`, which ZAYA1-VL's processor uses):

  refuse an image with a side below f = patch_size * merge_size pixels (transformers' Qwen2-VL
    processor did up to 4.50 and GLM-4V's still does; 5.25's Qwen2-VL upsizes it instead)
  resize (bicubic, Pillow) to h x w, each a multiple of f, keeping the
    aspect ratio, with h * w within [min_pixels, max_pixels] (`smart_resize`)
  scale to [0, 1], normalise per channel with CLIP's mean and std
  patches of patch_size^2 pixels, block-major over merge_size^2 blocks (zaya_jax.model.vision.layout's
    order), each flattened channel x frame x row x column  -> [h*w / patch^2, F], grid (1, h/p, w/p)
In the text, an image is `vision_start`, one `image` placeholder per merged token, `vision_end`
(`image_span`).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import ml_collections
import numpy as np
from PIL import Image

from zaya_jax.config_files import PROCESSOR_FIELDS, vision_config
from zaya_jax.errors import UserError
from zaya_jax.model.vision.config import VisionConfig
from zaya_jax.model.vision.image_size import MAX_PIXELS, MIN_PIXELS, smart_resize

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclasses.dataclass(frozen=True)
class ImageProcessor:
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 1
    min_pixels: int = MIN_PIXELS
    max_pixels: int = MAX_PIXELS

    @classmethod
    def for_tower(cls, cfg: VisionConfig, **sizes) -> "ImageProcessor":
        return cls(cfg.patch_size, cfg.spatial_merge_size, cfg.temporal_patch_size, **sizes)

    def __call__(self, image: np.ndarray | Image.Image) -> tuple[np.ndarray, tuple[int, int, int]]:
        """An RGB (or grey, or RGBA) image, uint8 [H, W(, C)] or Pillow -> patches [N, F] float32 and
        its grid (1, h / patch, w / patch)."""
        return self.patches(self.resize(image))

    def size(self, height: int, width: int) -> tuple[int, int]:
        """The (height, width) an image of that size is resized to (`smart_resize` at this processor's factor)."""
        return smart_resize(height, width, self.patch_size * self.merge_size, self.min_pixels, self.max_pixels)

    def describe(self, height: int, width: int) -> str:
        """What the processor does to an image of that size, as one line: its resized size, its
        patch grid and its image tokens."""
        h, w = self.size(height, width)
        t, gh, gw = self.grid_of_size(height, width)
        return (f"{height}x{width} -> {h}x{w} pixels, grid {t} x {gh} x {gw} patches, "
                f"{t * gh * gw // self.merge_size ** 2} image tokens")

    def grid_of_size(self, height: int, width: int) -> tuple[int, int, int]:
        """The patch grid (1, h / patch, w / patch) of an image of that size."""
        h, w = self.size(height, width)
        return 1, h // self.patch_size, w // self.patch_size

    def grid(self, image: np.ndarray | Image.Image) -> tuple[int, int, int]:
        """An image's patch grid (1, h / patch, w / patch), without resizing or cutting it."""
        height, width = (image.height, image.width) if isinstance(image, Image.Image) else np.shape(image)[:2]
        return self.grid_of_size(height, width)

    def resize(self, image: np.ndarray | Image.Image) -> np.ndarray:
        """An image -> uint8 [h, w, 3] RGB at the processor's size (what a prepared record stores)."""
        pil = image if isinstance(image, Image.Image) else Image.fromarray(np.asarray(image))
        pil = pil.convert("RGB")
        h, w = self.size(pil.height, pil.width)
        return np.asarray(pil.resize((w, h), resample=Image.Resampling.BICUBIC))

    def patches(self, resized: np.ndarray) -> tuple[np.ndarray, tuple[int, int, int]]:
        """uint8 [h, w, 3] at the processor's size (`resize`) -> patches [N, F] float32 and its grid."""
        p, m = self.patch_size, self.merge_size
        h, w = resized.shape[:2]
        if h % (p * m) or w % (p * m):
            raise UserError(f"an image of {h}x{w} pixels: resize it first (sides multiples of {p * m})")
        pixels = resized.astype(np.float32) / 255.0
        pixels = ((pixels - np.asarray(CLIP_MEAN, np.float32)) / np.asarray(CLIP_STD, np.float32)).transpose(2, 0, 1)
        gh, gw = h // p, w // p
        blocks = pixels.reshape(3, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)  # gh gw mh mw C ph pw
        frames = np.broadcast_to(blocks[:, :, :, :, :, None], (*blocks.shape[:5], self.temporal_patch_size, p, p))
        return np.ascontiguousarray(frames.reshape(gh * gw, -1)), (1, gh, gw)

    def batch(self, images: Sequence[np.ndarray | Image.Image]) -> tuple[np.ndarray, list[tuple[int, int, int]]]:
        """Several images -> their patches concatenated [sum N, F] and their grids."""
        done = [self(image) for image in images]
        return np.concatenate([d[0] for d in done]), [d[1] for d in done]


def image_processor(config: ml_collections.ConfigDict) -> ImageProcessor:
    """The ImageProcessor of a config's `vision` section (config_files.vision_section): its tower's
    patches, its resize bounds."""
    tower, _ = vision_config(config)
    return ImageProcessor.for_tower(tower, **{k: int(config.vision[k]) for k in PROCESSOR_FIELDS
                                              if k in config.vision})


def image_span(grid: Sequence[int], image_id: int, start_id: int, end_id: int, merge_size: int = 2) -> list[int]:
    """One image's tokens in the text: start, t*h*w / merge^2 placeholders, end."""
    t, h, w = grid
    return [start_id] + [image_id] * (t * h * w // merge_size ** 2) + [end_id]


def read_image(path) -> Image.Image:
    """An image file as an RGB Pillow image, read whole; ValueError saying why when it cannot be
    (missing, unreadable, not an image Pillow knows, or no path at all)."""
    try:
        with Image.open(path) as image:
            return image.convert("RGB")
    except (OSError, ValueError, TypeError, AttributeError) as err:
        raise ValueError(f"cannot read it as an image ({err})") from err
