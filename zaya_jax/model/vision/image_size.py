"""The size an image is resized to before it is cut into patches (Qwen2-VL's `smart_resize`), and
the image processor's default bounds on its area: geometry the model's accounting needs without
the processor (data.vision.processor resizes with it).

  smart_resize(height, width, factor, min_pixels, max_pixels) -> (h, w)
    h, w multiples of factor (= patch_size * spatial_merge_size), h * w within [min_pixels, max_pixels]
"""

from __future__ import annotations

import math

from zaya_jax.errors import UserError

MIN_PIXELS = 56 * 56          # Qwen2-VL's processor's default bounds on a resized image's area
MAX_PIXELS = 28 * 28 * 1280


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The size an image is resized to: both sides multiples of `factor`, the area within
    [min_pixels, max_pixels], the aspect ratio kept as closely as that allows. An image with a
    side below `factor` pixels (less than one merged token's side) is refused."""
    if height < factor or width < factor:
        raise UserError(f"an image of {height}x{width} pixels is below the processor's minimum: each side must be "
                        f"at least {factor} pixels (patch_size x merge_size); give a larger image")
    if max(height, width) / min(height, width) > 200:
        raise UserError(f"an image of {height}x{width} pixels: its aspect ratio must be below 200")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w
