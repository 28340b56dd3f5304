"""The image processor against transformers 5.24's `Qwen2VLImageProcessorPil` (the processor
ZAYA1-VL's uses, Pillow's bicubic resize): pixel patches and grids, for images that need resizing
up (below min_pixels), down (above max_pixels), an odd aspect and none at all; and the placeholder
span has as many placeholders as the tower makes tokens from those patches."""

import numpy as np
import pytest

from zaya_jax.vision.config import VisionConfig
from zaya_jax.vision.layout import patch_layout
from zaya_jax.vision.processor import ImageProcessor, image_span, smart_resize

SIZES = dict(min_pixels=56 * 56, max_pixels=28 * 28 * 16)
SHAPES = [(20, 30), (300, 200), (57, 250), (56, 84)]   # up, down, odd aspect, already multiples of 28


def _images():
    rng = np.random.default_rng(0)
    return [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in SHAPES]


@pytest.mark.torch_reference  # transformers imports torch
def test_patches_and_grids_equal_transformers():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    theirs = Qwen2VLImageProcessorPil(patch_size=14, merge_size=2, temporal_patch_size=1, **SIZES)
    ours = ImageProcessor(**SIZES)
    for image in _images():
        ref = theirs(images=[image], return_tensors="np")
        patches, grid = ours(image)
        assert [list(grid)] == ref["image_grid_thw"].tolist()
        np.testing.assert_allclose(patches, ref["pixel_values"], rtol=1e-5, atol=1e-5)


def test_sizes_and_placeholders_fit_the_tower():
    ours = ImageProcessor(**SIZES)
    for (h, w), image in zip(SHAPES, _images()):
        rh, rw = smart_resize(h, w, 28, **SIZES)
        assert rh % 28 == rw % 28 == 0 and SIZES["min_pixels"] <= rh * rw <= SIZES["max_pixels"]
        patches, grid = ours(image)
        assert patches.shape == (rh * rw // 196, 3 * 14 * 14) and grid == (1, rh // 14, rw // 14)
        span = image_span(grid, 9, 7, 8)
        assert span[0] == 7 and span[-1] == 8
        assert len(span) - 2 == patch_layout([grid], VisionConfig()).tokens_per_image[0]
    assert ours(_images()[3])[1] == (1, 4, 6)   # 56 x 84 is kept as it is
