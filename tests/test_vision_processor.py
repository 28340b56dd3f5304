"""The image processor against transformers 5.25's `Qwen2VLImageProcessorPil` (the processor
ZAYA1-VL's uses, Pillow's bicubic resize): pixel patches and grids, for images that need resizing
up (below min_pixels), down (above max_pixels), an odd aspect and none at all; the placeholder
span has as many placeholders as the tower makes tokens from those patches; and the
preprocessor_config.json an export writes, loaded by transformers' own class, computes what ours
does (and ours reads transformers' own files as it does)."""

import json

import numpy as np
import pytest

from tests.vision_fixtures import VISION
from zaya_jax.checkpoints.hf_config import HFCheckpointError
from zaya_jax.checkpoints.hf_image_processor import image_processor_from_config, preprocessor_config, read_image_processor
from zaya_jax.data.vision.processor import ImageProcessor, image_span
from zaya_jax.errors import UserError
from zaya_jax.model.vision.config import VisionConfig
from zaya_jax.model.vision.image_size import smart_resize
from zaya_jax.model.vision.layout import patch_layout

SIZES = dict(min_pixels=56 * 56, max_pixels=28 * 28 * 16)
SHAPES = [(30, 40), (300, 200), (57, 250), (56, 84)]   # up, down, odd aspect, already multiples of 28


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


# (processor, tower, image sizes): ZAYA1-VL's patches with other bounds, and the digits demo's tower (patch 4)
# whose bounds of 256 pixels resize an 8x8 digit to 16x16; sizes at the minimum side, square, non-square
# below / between / above the bounds
EXPORTED = [(ImageProcessor(**SIZES), VisionConfig(), [(28, 28), (30, 97), (300, 200), (57, 250), (56, 84)]),
            (ImageProcessor.for_tower(VISION, min_pixels=256, max_pixels=256), VISION, [(8, 8), (9, 30), (40, 13)]),
            (ImageProcessor.for_tower(VISION, min_pixels=64, max_pixels=512), VISION, [(8, 8), (17, 90), (200, 33)])]


def _random_image(height: int, width: int) -> np.ndarray:
    return np.random.default_rng(height * 1000 + width).integers(0, 256, (height, width, 3), dtype=np.uint8)


@pytest.mark.torch_reference  # transformers imports torch
@pytest.mark.parametrize("ours,tower,sizes", EXPORTED)
def test_transformers_loads_our_preprocessor_config_and_we_read_theirs(ours, tower, sizes, tmp_path):
    """Our preprocessor_config.json loaded by transformers' AutoImageProcessor gives our grids and pixel
    values; the file transformers' own class saves with those settings, and a file in the older form
    (min_pixels / max_pixels at the top, no size, every other key left to the defaults but the patches),
    read by ours give the same processor."""
    from transformers import AutoImageProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    (tmp_path / "ours").mkdir()
    (tmp_path / "ours" / "preprocessor_config.json").write_text(json.dumps(preprocessor_config(ours)))
    theirs = AutoImageProcessor.from_pretrained(tmp_path / "ours")
    assert type(theirs).__name__.startswith("Qwen2VLImageProcessor")
    for height, width in sizes:
        image = _random_image(height, width)
        ref = theirs(images=[image], return_tensors="np")
        patches, grid = ours(image)
        assert [list(grid)] == ref["image_grid_thw"].tolist(), (height, width)
        np.testing.assert_allclose(patches, ref["pixel_values"], rtol=1e-5, atol=1e-5)
    Qwen2VLImageProcessorPil(patch_size=ours.patch_size, merge_size=ours.merge_size,
                             temporal_patch_size=ours.temporal_patch_size, min_pixels=ours.min_pixels,
                             max_pixels=ours.max_pixels).save_pretrained(tmp_path / "theirs")
    assert read_image_processor(tmp_path / "theirs", tower, report=pytest.fail) == ours
    older = {"image_processor_type": "Qwen2VLImageProcessor", "min_pixels": ours.min_pixels,
             "max_pixels": ours.max_pixels, "patch_size": ours.patch_size,
             "temporal_patch_size": ours.temporal_patch_size, "merge_size": ours.merge_size}
    assert image_processor_from_config(older, tower, "older") == ours
    (tmp_path / "older").mkdir()
    (tmp_path / "older" / "preprocessor_config.json").write_text(json.dumps(older))
    old_kind = AutoImageProcessor.from_pretrained(tmp_path / "older")
    for height, width in sizes:
        assert [list(ours.grid(_random_image(height, width)))] == \
            old_kind(images=[_random_image(height, width)], return_tensors="np")["image_grid_thw"].tolist()


def test_an_image_below_one_merged_token_is_refused_and_each_image_is_described():
    """A side below patch_size x merge_size pixels is refused (transformers' Qwen2-VL processor up to 4.50,
    GLM-4V's in 5.25: `height < factor or width < factor`); at the minimum it is accepted."""
    ours = ImageProcessor(**SIZES)
    for height, width in ((1, 1), (27, 500), (500, 27)):
        with pytest.raises(UserError, match=f"an image of {height}x{width} pixels is below the processor's minimum: "
                                            "each side must be at least 28 pixels"):
            ours.size(height, width)
    assert ours.describe(28, 28) == "28x28 -> 56x56 pixels, grid 1 x 4 x 4 patches, 4 image tokens"
    assert ours.describe(300, 200) == "300x200 -> 112x84 pixels, grid 1 x 8 x 6 patches, 12 image tokens"


@pytest.mark.parametrize("values,message", [
    ({"temporal_patch_size": 2}, "temporal_patch_size 2, but config.json's vision_config has temporal_patch_size 1"),
    ({"temporal_patch_size": None}, r"temporal_patch_size 2 \(transformers' default: the file has none\)"),
    ({"patch_size": 14}, "patch_size 14, but config.json's vision_config has patch_size 4"),
    ({"image_mean": [0.5, 0.5, 0.5]}, r"image_mean \[0.5, 0.5, 0.5\]; this processor computes with"),
    ({"do_normalize": False}, "do_normalize False"),
    ({"resample": 2}, "resample 2"),
    ({"size": {"height": 16, "width": 16}, "min_pixels": None, "max_pixels": None}, "size .*shortest_edge"),
    ({"image_processor_type": "CLIPImageProcessor"}, "image_processor_type 'CLIPImageProcessor'"),
])
def test_a_preprocessor_config_we_would_compute_differently_is_named(values, message):
    written = preprocessor_config(ImageProcessor.for_tower(VISION, min_pixels=256, max_pixels=256))
    changed = {k: v for k, v in {**written, **values}.items() if v is not None}
    with pytest.raises(HFCheckpointError, match=f"where: {message}"):
        image_processor_from_config(changed, VISION, "where")
