"""Writing an HF checkpoint quantized as transformers' quantizers write it (`convert to_hf --quantize`).

fp8 (FineGrainedFP8Config): every linear transformers' FP8 quantizer converts in ZAYA, the attention
projections (q, k, v current / delayed, o: `X.weight` [out, in]) and the experts (`gate_up_proj`,
`down_proj` [E, out, in]), as float8_e4m3fn with one `weight_scale_inv` (experts: `P_scale_inv`)
per block of `block` x `block`, by transformers' Fp8Quantize rule:
    scale = 448 / max|w| over the block (1 for an all-zero block), stored inverted; q = clip(w * scale)
rounded to the nearest e4m3. Where the block does not tile a weight, the last block of that axis is
partial (a [ceil(out/block), ceil(in/block)] grid, DeepSeek-V3's layout, the one transformers'
FP8Linear and FP8Experts allocate; transformers' Fp8Quantize would leave such a weight in float).
modules_to_not_convert: the router's linears (`model.layers.*.mlp.gate`) and the LM head; norms,
CCA convolutions and temperatures, residual scales and the embedding are not linears.

mxfp4 (Mxfp4Config): the experts only, blocked as transformers' loader reads ZAYA's experts
(zaya_jax.checkpoints.hf_quantized; quantization_config's "block_axis": "output" says so): [E, A, B]
as `_blocks` [E, B, A/32, 16] and `_scales` [E, B, A/32], 32-value blocks along A, the output axis;
the exponent of each 32 values rounded up (the triton kernels' default, DequantScaleRoundingMode
ROUND_UP): X = ceil(log2(max|w| / 6)), values w / 2^X rounded to the nearest e2m1.
modules_to_not_convert: attention, router, embedding, LM head.

An export that would quantize no tensor is refused (UserError): a quantized-format checkpoint always
holds a quantized tensor.

A ZAYA1-VL (zaya1_vl names): its text model's tensors as above, under `model.language_model.`; its
vision tower, patch merger and vision LoRA stay in float and are named in modules_to_not_convert.
"""

from __future__ import annotations

from typing import Iterable, Iterator

import ml_dtypes
import numpy as np

from zaya_jax.checkpoints.hf_quantized import MX_BLOCK
from zaya_jax.errors import UserError
from zaya_jax.checkpoints.quantize import BlockScaledArray

FP8_MAX = 448.0
ATTENTION = tuple(f"self_attn.{p}.weight" for p in ("qkv_proj.q_proj", "qkv_proj.k_proj", "qkv_proj.v_proj_current",
                                                     "qkv_proj.v_proj_delayed", "o_proj"))
EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
NOT_CONVERTED = {"fp8": ["model.layers.*.mlp.gate", "lm_head"],
                 "mxfp4": ["model.layers.*.self_attn", "model.layers.*.mlp.gate", "model.embed_tokens", "lm_head"]}


VL_NOT_CONVERTED = ["model.visual", r"model.language_model.layers.*_lora_[ab]"]  # the tower and merger, the LoRA


def quantization_config(method: str, block: int, vision_language: bool = False) -> dict:
    """config.json's quantization_config for `method` ("fp8" | "mxfp4"); `vision_language`: a
    zaya1_vl checkpoint's (its text modules under model.language_model., the vision modules in float)."""
    skip = NOT_CONVERTED[method]
    if vision_language:
        skip = [n.replace("model.", "model.language_model.", 1) for n in skip] + VL_NOT_CONVERTED
    if method == "fp8":
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [block, block],
                "modules_to_not_convert": skip}
    return {"quant_method": "mxfp4", "block_axis": "output", "modules_to_not_convert": skip}


def fp8_blocks(w: np.ndarray, block: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """float [..., R, C] -> (float8_e4m3fn [..., R, C], float32 scale_inv [..., ceil(R/br), ceil(C/bc)]);
    a partial last block's scale is from its own entries (the zeros padding it to whole blocks change no max)."""
    *lead, rows, cols = w.shape
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    padded = np.pad(np.asarray(w, np.float32), [(0, 0)] * len(lead) + [(0, grid[0] * block[0] - rows),
                                                                        (0, grid[1] * block[1] - cols)])
    grouped = padded.reshape(*lead, grid[0], block[0], grid[1], block[1])
    peak = np.abs(grouped).max(axis=(-3, -1))
    # 448 / peak as torch divides a number by a tensor (times its reciprocal): the same float32 bits
    scale = np.where(peak > 0, np.float32(FP8_MAX) * (np.float32(1) / np.where(peak > 0, peak, 1)), 1).astype(np.float32)
    values = np.clip(grouped * scale[..., :, None, :, None], -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)
    return values.reshape(padded.shape)[..., :rows, :cols], (np.float32(1) / scale).astype(np.float32)


def mxfp4_blocks(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float [E, A, B] (A a multiple of 32) -> (uint8 blocks [E, B, A/32, 16], uint8 e8m0 scales [E, B, A/32])."""
    stored = np.swapaxes(np.asarray(w, np.float32), -1, -2)
    grouped = stored.reshape(*stored.shape[:-1], -1, MX_BLOCK)
    peak = np.abs(grouped).max(axis=-1)
    with np.errstate(divide="ignore"):
        exponent = np.clip(np.ceil(np.log2(peak / 6.0)), -127, 127)
    exponent = np.where(peak > 0, exponent, -127).astype(np.int32)
    scaled = np.clip(np.ldexp(grouped, -exponent[..., None]), -6.0, 6.0)
    codes = scaled.astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0xF
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed, (exponent + 127).astype(np.uint8)


def quantizes(method: str, name: str, shape: tuple[int, ...]) -> bool:
    """Whether the export in `method` writes the float checkpoint's tensor `name` [shape] quantized:
    fp8 every attention projection and expert tensor (any block: partial ones at the edges), mxfp4 the
    expert tensors whose output axis (-2) its 32-value blocks tile."""
    if method == "fp8":
        return name.endswith(ATTENTION + EXPERTS)
    return name.endswith(EXPERTS) and not shape[-2] % MX_BLOCK


def quantized_tensors(tensors: Iterable[tuple[str, np.ndarray]], method: str, block: int,
                      dequantized: dict[str, np.ndarray]) -> Iterator[tuple[str, np.ndarray]]:
    """transformers' float checkpoint tensors (name, float32) -> the quantized checkpoint's; each
    quantized weight's dequantized float32 value goes into `dequantized` (what the export must read back as).
    UserError naming --quantize once they are all read if none was quantized: a checkpoint in a quantized
    format holds at least one quantized tensor."""
    experts = set()
    for name, tensor in tensors:
        if name.endswith(EXPERTS):
            experts.add(tuple(tensor.shape))
        if not quantizes(method, name, tensor.shape):
            yield name, tensor
        elif method == "fp8":
            values, scale_inv = fp8_blocks(tensor, (block, block))
            yield name, values
            yield (name + "_scale_inv"), scale_inv
            dequantized[name] = np.asarray(BlockScaledArray(values, scale_inv, "fp8", False, tensor.shape[-2:],
                                                            (block, block))[...])
        else:
            blocks, scales = mxfp4_blocks(tensor)
            yield name + "_blocks", blocks
            yield name + "_scales", scales
            dequantized[name] = np.asarray(BlockScaledArray(blocks.reshape(*blocks.shape[:-2], -1), scales, "mxfp4",
                                                            True, tensor.shape[-2:])[...])
    if not dequantized:
        what = ("the attention projections and experts, of which it has none" if method == "fp8" else
                f"the expert tensors [E, A, B] with A a multiple of {MX_BLOCK}; this model's are "
                f"{', '.join(map(str, sorted(experts))) or 'none'}")
        raise UserError(f"--quantize {method}: no tensor of this model would be quantized ({method} quantizes {what}); "
                        "export it in float (no --quantize)" + (" or with --quantize fp8" if method != "fp8" else ""))
