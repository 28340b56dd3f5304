"""A zaya1_vl directory's image processor: `preprocessor_config.json`, as transformers' Qwen2-VL
image processor (`Qwen2VLImageProcessor`, which ZAYA1-VL's `Zaya1VLProcessor` holds) saves and
reads it, <-> zaya_jax.data.vision.processor.ImageProcessor.

  preprocessor_config(processor)           -> the JSON dict to write
  read_image_processor(dir, vision, report) -> ImageProcessor (no file: transformers' default
                                              sizes and the tower's patches, said in one line)
  compare_image_processors(source, written) -> what was checked; ExportMismatch where a probe image
                                              gives other patches or image tokens

Reading follows transformers 5.25's `Qwen2VLImageProcessor.__init__`: `size` {shortest_edge,
longest_edge} is the area's [min, max], a top-level `min_pixels` / `max_pixels` overrides it, and a
key the file lacks takes the class default (size 56*56 .. 28*28*1280, patch 14, temporal patch 2,
merge 2, CLIP's mean and std, bicubic, rescale 1/255). Every key that processor computes with is
either used (the sizes) or must hold the value ImageProcessor computes with (refused by name
otherwise); keys it does not compute with are ignored, as it ignores them.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable

import numpy as np

from zaya_jax.checkpoints.export_check import ExportMismatch
from zaya_jax.checkpoints.hf_config import HFCheckpointError
from zaya_jax.model.vision.config import VisionConfig
from zaya_jax.data.vision.processor import CLIP_MEAN, CLIP_STD, ImageProcessor

PREPROCESSOR_CONFIG = "preprocessor_config.json"
IMAGE_PROCESSOR_TYPES = ("Qwen2VLImageProcessor", "Qwen2VLImageProcessorPil", "Qwen2VLImageProcessorFast")
BICUBIC = 3  # PIL.Image.Resampling.BICUBIC, transformers' `resample`
DEFAULT_SIZE = {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 1280}  # transformers' class defaults
# key: (transformers' default, what ImageProcessor computes with); the patch keys are the tower's
FIXED = {"do_convert_rgb": (True, True), "do_resize": (True, True), "do_rescale": (True, True),
         "do_normalize": (True, True), "resample": (BICUBIC, BICUBIC), "rescale_factor": (1 / 255, 1 / 255),
         "image_mean": (list(CLIP_MEAN), list(CLIP_MEAN)), "image_std": (list(CLIP_STD), list(CLIP_STD))}
PATCH_KEYS = {"patch_size": (14, "patch_size"), "temporal_patch_size": (2, "temporal_patch_size"),
              "merge_size": (2, "spatial_merge_size")}  # key: (transformers' default, VisionConfig field)


def preprocessor_config(processor: ImageProcessor) -> dict[str, Any]:
    """The preprocessor_config.json of `processor` (transformers' keys; min_pixels / max_pixels
    beside `size` for transformers before 5.x, which read those)."""
    return {"image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Zaya1VLProcessor",
            **{key: ours for key, (_, ours) in FIXED.items()},
            "size": {"shortest_edge": processor.min_pixels, "longest_edge": processor.max_pixels},
            "min_pixels": processor.min_pixels, "max_pixels": processor.max_pixels,
            "patch_size": processor.patch_size, "temporal_patch_size": processor.temporal_patch_size,
            "merge_size": processor.merge_size}


def _same(a, b) -> bool:
    if isinstance(b, list):
        return isinstance(a, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(b, float):
        return isinstance(a, (int, float)) and not isinstance(a, bool) and math.isclose(a, b, rel_tol=1e-6)
    return type(a) is type(b) and a == b


def image_processor_from_config(values: dict[str, Any], vision: VisionConfig, where: str) -> ImageProcessor:
    """A preprocessor_config.json dict -> the ImageProcessor that computes what transformers' would,
    for the tower `vision`; HFCheckpointError naming `where` and the key where it cannot."""
    kind = values.get("image_processor_type", IMAGE_PROCESSOR_TYPES[0])
    if kind not in IMAGE_PROCESSOR_TYPES:
        raise HFCheckpointError(f"{where}: image_processor_type {kind!r}; a zaya1_vl model's images are prepared by "
                                f"{IMAGE_PROCESSOR_TYPES[0]}")
    for key, (default, ours) in FIXED.items():
        if not _same(values.get(key, default), ours):
            raise HFCheckpointError(f"{where}: {key} {values.get(key, default)!r}; this processor computes with "
                                    f"{ours!r} only (Qwen2-VL's)")
    for key, (default, field) in PATCH_KEYS.items():
        value, tower = values.get(key, default), getattr(vision, field)
        if value != tower:
            told = "" if key in values else " (transformers' default: the file has none)"
            raise HFCheckpointError(f"{where}: {key} {value!r}{told}, but config.json's vision_config has {field} "
                                    f"{tower}: the patches would not fit the tower; set {key} to {tower}")
    size = dict(values.get("size") or DEFAULT_SIZE)
    for key, edge in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
        if values.get(key) is not None:
            size[edge] = values[key]
    bounds = [size.get(edge) for edge in ("shortest_edge", "longest_edge")]
    if not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in bounds) or bounds[0] > bounds[1]:
        raise HFCheckpointError(f"{where}: size {values.get('size')!r}: transformers' Qwen2-VL processor needs "
                                "positive integers shortest_edge <= longest_edge (the image area's min and max pixels)")
    return ImageProcessor.for_tower(vision, min_pixels=bounds[0], max_pixels=bounds[1])


def read_image_processor(directory: str | Path, vision: VisionConfig,
                         report: Callable[[str], None]) -> ImageProcessor:
    """The image processor of a zaya1_vl directory: its preprocessor_config.json, else (said through
    `report` in one line) transformers' default sizes cut into the tower's patches."""
    path = Path(directory) / PREPROCESSOR_CONFIG
    if not path.is_file():
        processor = ImageProcessor.for_tower(vision)
        report(f"note: {directory} has no {PREPROCESSOR_CONFIG}: images are resized as transformers' Qwen2-VL "
               f"image processor does by default (min_pixels {processor.min_pixels}, max_pixels "
               f"{processor.max_pixels}) into the tower's patches (patch_size {processor.patch_size}, merge_size "
               f"{processor.merge_size}, temporal_patch_size {processor.temporal_patch_size})")
        return processor
    try:
        values = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise HFCheckpointError(f"{path}: not valid JSON ({err})") from err
    if not isinstance(values, dict):
        raise HFCheckpointError(f"{path}: not a JSON object")
    return image_processor_from_config(values, vision, str(path))


def probe_sizes(processor: ImageProcessor) -> list[tuple[int, int]]:
    """(height, width) of images that take each path of the resize: the smallest accepted (one
    merged token's side), a non-square one between the bounds (or below min_pixels), and a non-square
    one above max_pixels."""
    factor = processor.patch_size * processor.merge_size
    side = math.isqrt(processor.max_pixels) + factor
    return [(factor, factor), (3 * factor + 1, 2 * factor - 1), (side + side // 2, side)]


def compare_image_processors(source: ImageProcessor, written: ImageProcessor) -> str:
    """The same probe images give the same grids, image tokens and patches through both (else
    ExportMismatch); returns what was checked."""
    rng = np.random.default_rng(0)
    for height, width in probe_sizes(source):
        image = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
        (want, want_grid), (got, got_grid) = source(image), written(image)
        if want_grid != got_grid or written.merge_size != source.merge_size or not np.array_equal(want, got):
            raise ExportMismatch(f"the zaya1_vl export's {PREPROCESSOR_CONFIG} cuts a {height}x{width} image into "
                                 f"grid {got_grid} (the source: {want_grid}) or other patches; nothing was written")
    return f"the image processor's grids, image tokens and patches on {len(probe_sizes(source))} probe images"
