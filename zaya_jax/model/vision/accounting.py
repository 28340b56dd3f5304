"""ZAYA1-VL's parameter counts and its vision tower's FLOPs, from an abstract init (nothing allocated).

Parameters: the text model's groups (zaya_jax.model.accounting, with its vision LoRA apart) and the
tower's: the patch embedding, the blocks, the patch merger (the projector to the text width).
Active per token: the text model's active parameters (one expert and that expert's vision LoRA) and
the whole tower (every patch of an image runs it). ZAYA1-VL-8B (configs/zaya1_vl_8b.py): 9.2B
without the embedding, 1.4B of them active, the report's figures.

Forward matmul FLOPs of the tower on one image of P patches (d width, i MLP width, F patch
features, M patches merged per token, O the text width):
  patch embedding   2 P F d
  each block        2 P d 3d (qkv) + 2 P d d (out) + 3 * 2 P d i (SwiGLU)
                    + 2 * 2 P P d (scores and values: the XLA path attends every patch of the
                    example under the window or frame mask, so a windowed block costs a full one)
  merger            2 (P/M) (M d)^2 + 2 (P/M) M d O
tests/test_vision_accounting.py checks the counts against transformers' modules and the FLOPs
against XLA's cost analysis of the compiled tower.
"""

from __future__ import annotations

import functools

import numpy as np
from flax import nnx

from zaya_jax.config import ModelConfig
from zaya_jax.model.accounting import model_summary
from zaya_jax.model.vision.config import VisionConfig
from zaya_jax.model.vision.image_size import MAX_PIXELS, MIN_PIXELS, smart_resize
from zaya_jax.model.vision.tower import VisionTower

_TOWER_GROUPS = (("vision patch embedding", "patch_kernel"), ("vision blocks", "blocks"),
                 ("vision merger (projector)", "merger"))


@functools.lru_cache(maxsize=4)
def tower_parameter_state(vision: VisionConfig) -> nnx.State:
    """The tower's abstract nnx.Param state (built once per config; the planner's mesh search reads it
    for every mesh)."""
    return nnx.state(nnx.eval_shape(lambda: VisionTower(vision, rngs=nnx.Rngs(0))), nnx.Param)


def vision_breakdown(vision: VisionConfig) -> dict[str, int]:
    """The tower's parameters per group."""
    params = tower_parameter_state(vision)
    counts = {name: 0 for name, _ in _TOWER_GROUPS}
    group = {top: name for name, top in _TOWER_GROUPS}
    for path, leaf in nnx.to_flat_state(params):
        counts[group[str(path[0])]] += int(np.prod(leaf.shape))
    return counts


def tower_forward_flops_by_part(vision: VisionConfig, patches: int) -> dict[str, int]:
    """Forward matmul FLOPs of the tower on one image (or one row) of `patches` patches, by part (the
    module doc's count): patch_embedding, blocks (their weight matmuls), block_attention (scores and
    values), merger."""
    p, d, i, m = patches, vision.hidden_size, vision.intermediate_size, vision.merge_unit
    return {"patch_embedding": 2 * p * vision.patch_dim * d,
            "blocks": vision.depth * (2 * p * d * 3 * d + 2 * p * d * d + 3 * 2 * p * d * i),
            "block_attention": vision.depth * 2 * 2 * p * p * d,
            "merger": 2 * (p // m) * (m * d) ** 2 + 2 * (p // m) * m * d * vision.out_hidden_size}


def tower_forward_flops(vision: VisionConfig, patches: int) -> int:
    """Forward matmul FLOPs of the tower on one image of `patches` patches (the module doc's count)."""
    return sum(tower_forward_flops_by_part(vision, patches).values())


def vl_model_summary(text: ModelConfig, vision: VisionConfig, image_size: tuple[int, int] = (448, 448)) -> dict:
    """model_summary(text) with the tower's groups added to the breakdown and the totals, its fp32
    parameter bytes, and one image of `image_size` pixels (height, width) as the processor resizes
    it: its patches, its text tokens and the tower's forward FLOPs on it."""
    summary = model_summary(text)
    tower = vision_breakdown(vision)
    n = sum(tower.values())
    for key in ("params_total", "params_non_embedding", "params_active_non_embedding", "params_active_total"):
        summary[key] += n
    summary["breakdown"] = {**summary["breakdown"], **tower}
    h, w = smart_resize(*image_size, vision.patch_size * vision.spatial_merge_size, MIN_PIXELS, MAX_PIXELS)
    patches = (h // vision.patch_size) * (w // vision.patch_size)
    summary["vision"] = {"params": n, "param_bytes_fp32": 4 * n,
                         "image": {"pixels": list(image_size), "resized_to": [h, w], "patches": patches,
                                   "tokens": patches // vision.merge_unit,
                                   "forward_flops": tower_forward_flops(vision, patches)}}
    return summary

