"""The vision tower's share of a vision-language train step (a config with a `vision` section,
ZAYA1-VL): its activations and its matmul FLOPs per device. Its parameters, gradients, optimizer
state and their collectives are step_plan's, counted with the text model's (step_plan._parameters
lists the tower's under `vision/`, sharded by the trainer's rules).

Shapes: R rows per device and micro-batch, P = train.patch_capacity patches per row (the tower runs
on [R, P, F] and attends all P patches of a row under the window or image mask), d width, n heads,
i MLP width, M patches merged per token, O the text width; heads and MLP split over `tensor`
(rules: vision_heads, vision_mlp). The blocks run in a scan under the text model's remat policy
(zaya_jax.model.vision.tower); the patch embedding and the merger run outside it.

Numbers one block keeps per patch for the backward pass (estimate):
  full                                the block input d
  dots_no_batch(_and_kernels)         + the weight matmuls' outputs: qkv 3d, output d, gate, up i, down d
  dots                                + the attention scores n P and values d (dot_generals too)
  none                                every intermediate: + the fp32 logits and probabilities 2 n P
                                        instead of the scores, 2 norms, rotated q and k, SwiGLU's 2 i, the
                                        residual
plus, once, the patch embedding output d and the merger's norm, fc1, GELU (d each) and output O/M.

FLOPs per row: zaya_jax.model.vision.accounting.tower_forward_flops_by_part, with passes: the patch
embedding 2 (forward, weight gradient: the patches need none), the blocks' weight matmuls and the
merger 3, plus 1 for the blocks under `full` remat, the attention scores 3 plus 1 where the policy
recomputes them (every policy but `none` and `dots`: they are batched dot_generals).
"""

from __future__ import annotations

from zaya_jax.model.vision.accounting import tower_forward_flops_by_part
from zaya_jax.model.vision.config import VisionConfig


def saved_numbers_per_patch_per_block(v: VisionConfig, remat: str, patches: int, tensor: int) -> float:
    """Numbers one tower block keeps per patch for the backward pass (the module doc's list)."""
    d, n, i = v.hidden_size, v.num_heads / tensor, v.intermediate_size / tensor
    if remat == "full":
        return d
    weight_dots = 3 * d / tensor + d + 2 * i + d
    if remat in ("dots_no_batch", "dots_no_batch_and_kernels"):
        return d + weight_dots
    if remat == "dots":
        return d + weight_dots + n * patches + d / tensor
    return d + weight_dots + 2 * n * patches + d / tensor + 2 * d + 2 * d / tensor + 2 * i + d


def tower_activation_memory(v: VisionConfig, remat: str, rows: float, patches: int, tensor: int) -> dict[str, float]:
    """Bytes per device the tower keeps for the backward of `rows` rows of `patches` patches, and what
    one block's backward holds at once (every intermediate of one block)."""
    dtype_bytes = 2 if v.dtype == "bfloat16" else 4
    once = v.hidden_size + 3 * v.hidden_size + v.out_hidden_size / v.merge_unit
    saved = v.depth * saved_numbers_per_patch_per_block(v, remat, patches, tensor) + once
    live = saved_numbers_per_patch_per_block(v, "none", patches, tensor)
    return {"vision_activations_saved": rows * patches * saved * dtype_bytes,
            "vision_activations_live_block": rows * patches * live * dtype_bytes}


def tower_step_flops(v: VisionConfig, remat: str, rows: float, patches: int, tensor: int) -> dict[str, float]:
    """Matmul FLOPs of the tower per device and step on `rows` rows (summed over the micro-batches)
    of `patches` patches, forward, backward and recompute (the module doc's passes)."""
    part = tower_forward_flops_by_part(v, patches)
    scores_recomputed = remat not in ("none", "dots")
    passes = {"patch_embedding": 2, "blocks": 3 + (remat == "full"), "block_attention": 3 + scores_recomputed,
              "merger": 3}
    return {f"vision_tower/{name}": rows * flops * passes[name] / tensor for name, flops in part.items()}
