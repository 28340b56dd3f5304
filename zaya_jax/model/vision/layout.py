"""Where each patch of a batch of images sits: its 2D position and the attention groups it belongs to.

Computed on the host from the images' patch grids (transformers' `image_grid_thw`: frames, height
and width in patches per image), once per batch, and passed to the tower as arrays, so that one
compiled tower serves every batch with the same number of patches.

Patch order is the processor's (Qwen2-VL's `Qwen2VLImageProcessor`): image by image, frame by
frame, then block-major over the m x m merge blocks (m = spatial_merge_size):
  patch k of a frame -> block (bi, bj), offset (di, dj), k = ((bi * w/m + bj) * m + di) * m + dj,
  height h = bi*m + di, width w = bj*m + dj
so the m*m patches of a merged text token are consecutive.

Attention groups (ids from 1; 0 marks padding patches, which attend nothing useful and are dropped):
  image_segments   one group per frame of each image: the blocks of fullatt_block_indexes
  window_segments  one group per window of window_units x window_units merge blocks within a frame
                   (edge windows are smaller): every other block
transformers reorders the patches window by window so its variable-length kernels see contiguous
windows, and undoes it after the merger; a mask over the processor's order computes the same
attention, so the tower keeps that order throughout.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np

from zaya_jax.config import ConfigError
from zaya_jax.model.vision.config import VisionConfig


class PatchLayout(NamedTuple):
    positions: np.ndarray        # [N, 2] int32: (height, width) of each patch in its frame
    image_segments: np.ndarray   # [N] int32: frame group, 0 on padding
    window_segments: np.ndarray  # [N] int32: window group, 0 on padding
    tokens_per_image: tuple[int, ...]  # merged tokens (image placeholders) of each image


def check_grid(grid_thw: Sequence[Sequence[int]], cfg: VisionConfig) -> list[tuple[int, int, int]]:
    grids = [tuple(int(x) for x in g) for g in grid_thw]
    m = cfg.spatial_merge_size
    for i, g in enumerate(grids):
        if len(g) != 3 or min(g) <= 0 or g[1] % m or g[2] % m:
            raise ConfigError(f"image {i}: grid (frames, height, width) = {g} must be positive with height and "
                              f"width in patches multiples of spatial_merge_size ({m}); resize the image to "
                              f"multiples of {m * cfg.patch_size} pixels (the image processor, data.vision.processor, does)")
    return grids


def patch_layout(grid_thw: Sequence[Sequence[int]], cfg: VisionConfig, pad_to: int | None = None) -> PatchLayout:
    """grid_thw: one (frames, height, width) in patches per image -> the layout of their patches,
    padded with group 0 to `pad_to` patches when given."""
    grids = check_grid(grid_thw, cfg)
    m, units = cfg.spatial_merge_size, cfg.window_units
    positions, images, windows, tokens = [], [], [], []
    image_id = window_id = 0
    for t, h, w in grids:
        bh, bw = h // m, w // m
        bi, bj, di, dj = np.meshgrid(np.arange(bh), np.arange(bw), np.arange(m), np.arange(m), indexing="ij")
        hw = np.stack([bi * m + di, bj * m + dj], axis=-1).reshape(-1, 2)
        windows_w = -(-bw // units)
        window_of = ((bi // units) * windows_w + bj // units).reshape(-1)
        for _ in range(t):
            positions.append(hw)
            image_id += 1
            images.append(np.full(h * w, image_id))
            windows.append(window_id + 1 + window_of)
            window_id += -(-bh // units) * windows_w
        tokens.append(t * bh * bw)
    n = sum(t * h * w for t, h, w in grids)
    if pad_to is not None and pad_to < n:
        raise ConfigError(f"the images have {n} patches, more than the {pad_to} the batch holds; "
                          "raise the patch budget or send fewer or smaller images")
    pad = 0 if pad_to is None else pad_to - n
    def as_int(parts: list[np.ndarray]) -> np.ndarray:
        return np.concatenate(parts + [np.zeros((pad,) + parts[0].shape[1:], parts[0].dtype)]).astype(np.int32)
    return PatchLayout(as_int(positions), as_int(images), as_int(windows), tuple(tokens))


def patch_row(patches: Sequence[np.ndarray], grid_thw: Sequence[Sequence[int]], cfg: VisionConfig,
              pad_to: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """One example's images (patches [N_i, F] each, their grids; none is allowed) -> (patches
    float32 [P, F], positions [P, 2], image_segments [P], window_segments [P]), P = pad_to: one row
    of an ImageBatch."""
    rows = np.zeros((pad_to, cfg.patch_dim), np.float32)
    if not len(grid_thw):
        return rows, np.zeros((pad_to, 2), np.int32), np.zeros(pad_to, np.int32), np.zeros(pad_to, np.int32)
    layout = patch_layout(grid_thw, cfg, pad_to=pad_to)
    joined = np.concatenate(list(patches))
    rows[:len(joined)] = joined
    return rows, layout.positions, layout.image_segments, layout.window_segments
