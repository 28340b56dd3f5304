"""Reading HF checkpoints that transformers' FP8 and MXFP4 quantizers wrote (config.json's
`quantization_config`), keeping the experts and attention projections quantized in memory.

quant_method "fp8" (transformers' FineGrainedFP8Config, DeepSeek-V3's layout): a quantized linear
`X.weight` is float8_e4m3fn [out, in] beside `X.weight_scale_inv` float32 [ceil(out/bo), ceil(in/bi)],
one multiplier per (bo, bi) block of `weight_block_size`, the last block of an axis partial where bo
(bi) does not divide it: block (i, j) holds rows i*bo .. min((i+1)*bo, out), as transformers' FP8Linear
allocates and its kernels read (null: one per tensor, [] / [1] / [1, 1]; a per-tensor `X.weight_scale`
is read the same way); a quantized 3-D expert tensor `...experts.P` [E, out, in] has
`...experts.P_scale_inv` [E, ceil(out/bo), ceil(in/bi)]. Dequantized: w = value * scale.
Only activation_scheme "dynamic" (the scheme transformers writes), float scales (scale_fmt "float")
and fp8 experts (expert_dtype "fp8") are read.

quant_method "mxfp4" (transformers' Mxfp4Config): an expert tensor `...experts.P` [E, out, in] is
stored as `P_blocks` uint8 [E, X, Y/32, 16] (two e2m1 codes per byte, low nibble first) and
`P_scales` uint8 [E, X, Y/32] (e8m0: 2^(s - 127) per 32 values along Y). Which axis the 32-value
blocks run along is quantization_config's "block_axis" (a zaya_jax key; transformers reads none):
  "output": Y = out, X = in ([E, in, out/32, 16]): how transformers' loader reads ZAYA's experts
            (integrations/mxfp4.py convert_moe_packed_tensors unpacks [E, in, out], swaps the last
            two axes); for `gate_up_proj` [E, 2I, D] the blocks run along 2I, for `down_proj` along D.
  "input":  Y = in, X = out ([E, out, in/32, 16]): blocks along the contraction axis, as MX matmul
            kernels and gpt-oss's files lay them.
A file stating none is read "output" (transformers' reading), said in one line on load; the loaders'
`mxfp4_block_axis` (CLIs: --mxfp4_block_axis) chooses, over the file's key too. A square tensor
(ZAYA1-8B's down_proj [16, 2048, 2048]) has the same shape either way: only the key tells them apart.

Which tensors are quantized is read from the tensors (a weight with its scales, or its blocks);
`modules_to_not_convert` (transformers' matching: a prefix ending at a module boundary, a regex, or a
suffix) names modules that must be stored in float. Kept quantized in memory, as BlockScaledArray
(zaya_jax.checkpoints.quantize), dequantized inside the computation that reads them: the attention
projections (q, k, v current / delayed, o) and the experts (gate, up, down) of the text model.
Everything else stored quantized (a router linear, a vision tower's linears, LoRA, a fused expert
tensor whose gate and up halves are not whole blocks) is dequantized to float32 on load (get), bit
for bit as transformers' dequantizers do.
"""

from __future__ import annotations

import re
import sys
from typing import Callable, NamedTuple

import numpy as np

from zaya_jax.checkpoints.hf_config import HFCheckpointError
from zaya_jax.checkpoints.hf_names import Entry
from zaya_jax.errors import UserError
from zaya_jax.checkpoints.quantize import QUANTIZED_WEIGHTS, BlockScaledArray

MX_BLOCK = 32
METHODS = ("fp8", "mxfp4")
BLOCK_AXES = ("output", "input")   # mxfp4: the axis of [E, out, in] its 32-value blocks run along
BLOCK_AXIS_HELP = ("--hf: the axis an MXFP4 checkpoint's expert blocks run along, output (transformers' reading) "
                   "or input (the contraction axis); default: its quantization_config.block_axis, else output.")


class CheckpointQuantization(NamedTuple):
    method: str                        # "fp8" | "mxfp4"
    block: tuple[int, int] | None      # fp8: weight_block_size (rows, cols); None: one scale per tensor
    not_converted: tuple[str, ...]     # modules_to_not_convert
    block_axis: str | None = None      # mxfp4: "output" | "input" (BLOCK_AXES); fp8: None


def read_quantization(hf: dict, key: str = "quantization_config",
                      mxfp4_block_axis: str | None = None) -> CheckpointQuantization | None:
    """config.json's quantization_config -> CheckpointQuantization (None without one); anything this
    reader would compute differently from transformers is refused naming the field. mxfp4_block_axis:
    the MXFP4 block axis to read (None: the file's block_axis, else "output", said on stderr)."""
    q = hf.get(key)
    if q is None:
        return None
    if not isinstance(q, dict):
        raise HFCheckpointError(f"config.json: {key} must be an object, got {q!r}")
    method = q.get("quant_method")
    if method not in METHODS:
        raise HFCheckpointError(f"config.json: {key}.quant_method={method!r} is not read here; zaya_jax reads 'fp8' "
                                "(transformers' FineGrainedFP8Config) and 'mxfp4' (Mxfp4Config): dequantize it with "
                                "transformers (quantization_config with dequantize=True) and save_pretrained it")
    skip = q.get("modules_to_not_convert") or []
    if not isinstance(skip, list) or not all(isinstance(s, str) for s in skip):
        raise HFCheckpointError(f"config.json: {key}.modules_to_not_convert must be a list of module names, "
                                f"got {skip!r}")
    block = None
    if method == "fp8":
        for field, allowed in (("activation_scheme", "dynamic"), ("scale_fmt", "float"), ("expert_dtype", "fp8")):
            if q.get(field, allowed) != allowed:
                raise HFCheckpointError(f"config.json: {key}.{field}={q[field]!r} is not read here (zaya_jax reads "
                                        f"{allowed!r}, transformers' default)")
        block = q.get("weight_block_size", [128, 128])
        if block is not None:
            if (not isinstance(block, list) or len(block) != 2
                    or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
                raise HFCheckpointError(f"config.json: {key}.weight_block_size={block!r} must be two positive "
                                        "integers, e.g. [128, 128], or null (one scale per tensor)")
            block = tuple(block)
    axis = mxfp4_axis(q.get("block_axis"), mxfp4_block_axis, key) if method == "mxfp4" else None
    return CheckpointQuantization(method, block, tuple(skip), axis)


def mxfp4_axis(stated, chosen: str | None, key: str = "quantization_config") -> str:
    """The MXFP4 block axis to read: `chosen` (load_hf's mxfp4_block_axis), else the file's `stated`
    block_axis, else "output" (transformers' reading), the last two cases said in one line on stderr."""
    if chosen is not None and chosen not in BLOCK_AXES:
        raise UserError(f"mxfp4_block_axis={chosen!r} is not a block axis; choose one of {list(BLOCK_AXES)}")
    if stated is not None and stated not in BLOCK_AXES:
        raise HFCheckpointError(f"config.json: {key}.block_axis={stated!r} is not a block axis; zaya_jax reads one "
                                f"of {list(BLOCK_AXES)} (or pass mxfp4_block_axis / --mxfp4_block_axis)")
    if chosen is not None:
        if stated is not None and stated != chosen:
            print(f"note: reading MXFP4 blocks along the {chosen} axis (mxfp4_block_axis), not config.json's "
                  f"{key}.block_axis={stated!r}", file=sys.stderr)
        return chosen
    if stated is None:
        print(f"note: config.json's {key} states no block_axis: reading the MXFP4 experts' blocks along the "
              "output axis as transformers does; for blocks along the contraction axis (MX kernels', gpt-oss's) "
              "pass mxfp4_block_axis='input' (--mxfp4_block_axis=input)", file=sys.stderr)
        return "output"
    return stated


def not_converted(module: str, patterns: tuple[str, ...]) -> bool:
    """Whether `module` (a dotted name) is one `modules_to_not_convert` leaves unquantized, matched as
    transformers matches them: a prefix or regex ending at a module boundary, or a suffix."""
    boundary = r"(?:(?<=\.)|(?=\.|$))"
    return any(re.match(rf"(?:{p}){boundary}", module) or module.endswith(p) for p in patterns)


def _module(name: str) -> str:
    """The module a tensor name belongs to ('a.b.weight' -> 'a.b'; an expert tensor 'a.experts.gate_up_proj'
    -> 'a.experts')."""
    return name.rsplit(".", 1)[0]


class QuantizedTensors:
    """A quantized checkpoint's tensors seen as the float checkpoint they stand for.

    names(): the float checkpoint's names (each weight once, without its scales / blocks);
    get(name) -> float32 array (dequantized when stored quantized); kept(entry): whether its weights
    stay quantized in memory; stored(entry) -> (values, scales) numpy per target of a kept entry.
    """

    def __init__(self, quant: CheckpointQuantization, names: set[str], get_tensor: Callable[[str], np.ndarray],
                 where: str):
        self.quant, self.get_tensor, self.where = quant, get_tensor, where
        self.scale_of: dict[str, str] = {}      # weight name -> its scale tensor's name
        if quant.method == "mxfp4":
            for name in sorted(n for n in names if n.endswith(("_blocks", "_scales"))):
                weight = name.rsplit("_", 1)[0]
                if weight + "_blocks" not in names:
                    raise HFCheckpointError(f"{where}: tensor {name!r} has no {weight + '_blocks'!r} to scale")
                if weight + "_scales" not in names:
                    raise HFCheckpointError(f"{where}: missing scales: tensor {name!r} has no {weight + '_scales'!r} "
                                            "(mxfp4 stores one e8m0 exponent per 32 values beside each *_blocks "
                                            "tensor)")
                self.scale_of[weight] = weight + "_scales"
            stored = set(self.scale_of.values()) | {w + "_blocks" for w in self.scale_of}
        else:
            for name in sorted(names):
                # X.weight_scale_inv / X.weight_scale (per tensor) scale X.weight; experts.P_scale_inv scales experts.P
                weight = (name[:-len("_scale_inv")] if name.endswith("_scale_inv")
                          else name[:-len("_scale")] if name.endswith(".weight_scale") else None)
                if weight is None:
                    continue
                if weight not in names:
                    raise HFCheckpointError(f"{where}: tensor {name!r} scales {weight!r}, which the checkpoint lacks")
                if weight in self.scale_of:
                    raise HFCheckpointError(f"{where}: tensor {weight!r} has two scales, {self.scale_of[weight]!r} "
                                            f"and {name!r}")
                self.scale_of[weight] = name
            stored = set()
        self.logical = (names - stored - set(self.scale_of.values())) | set(self.scale_of)
        for weight in self.scale_of:
            if not_converted(_module(weight), quant.not_converted):
                raise HFCheckpointError(f"{where}: tensor {weight!r} is stored quantized, but config.json's "
                                        f"quantization_config.modules_to_not_convert names its module "
                                        f"{_module(weight)!r}: remove it from that list or store it in float")

    def names(self) -> set[str]:
        return set(self.logical)

    def get(self, name: str) -> np.ndarray:
        """-> float32 of the tensor's float shape (dequantized as transformers does, when quantized)."""
        if name not in self.scale_of:
            tensor = self.get_tensor(name)
            if str(tensor.dtype).startswith("float8"):
                scale = name + "_scale_inv" if name.endswith(".weight") or self.quant.method == "fp8" else name
                raise HFCheckpointError(f"{self.where}: missing scales: tensor {name!r} is {tensor.dtype} but the "
                                        f"checkpoint has no {scale!r} (nor a per-tensor {name + '_scale'!r}) for it")
            return np.asarray(tensor, np.float32)
        return np.asarray(self._stored(name, None).dequantize())

    def _stored(self, name: str, hf_shape: tuple[int, ...] | None) -> BlockScaledArray:
        """The stored tensor as one BlockScaledArray whose dequantize() is its float [..] tensor."""
        scale = self.get_tensor(self.scale_of[name])
        if self.quant.method == "mxfp4":
            blocks = self.get_tensor(name + "_blocks")
            if hf_shape is not None:
                # [E, X, Y/32, 16] for [E, out, in]: blocks along Y, out ("output") or in ("input")
                x, y = hf_shape[-2:] if self.transposed_in_memory else hf_shape[:-3:-1]
                expected = (*hf_shape[:-2], x, y // MX_BLOCK, MX_BLOCK // 2)
                if len(hf_shape) != 3 or y % MX_BLOCK or tuple(blocks.shape) != expected:
                    form = "[E, out, in/32, 16]" if self.transposed_in_memory else "[E, in, out/32, 16]"
                    raise HFCheckpointError(
                        f"{self.where}: mxfp4 tensor {name + '_blocks'!r} has shape {tuple(blocks.shape)}, expected "
                        f"{expected if len(hf_shape) == 3 and not y % MX_BLOCK else 'an expert tensor'} "
                        f"for {name!r} of shape {hf_shape} (blocks along its {self.quant.block_axis} axis: {form}, "
                        f"that axis a multiple of 32; the other axis: mxfp4_block_axis / --mxfp4_block_axis)")
            if blocks.dtype != np.uint8 or scale.dtype != np.uint8 or tuple(scale.shape) != tuple(blocks.shape[:-1]):
                raise HFCheckpointError(f"{self.where}: mxfp4 tensors {name + '_blocks'!r} {blocks.dtype} "
                                        f"{tuple(blocks.shape)} and {self.scale_of[name]!r} {scale.dtype} "
                                        f"{tuple(scale.shape)}: expected uint8 blocks [..., 16] and uint8 scales of "
                                        "their shape without the last axis")
            values = blocks.reshape(*blocks.shape[:-2], -1)
            stored = (values.shape[-2], values.shape[-1] * 2)
            # the float tensor [.., out, in]: the stored matrix, or its transpose when it is [in, out]
            inner = stored if self.transposed_in_memory else stored[::-1]
            return BlockScaledArray(values, scale, "mxfp4", not self.transposed_in_memory, inner)
        values = self.get_tensor(name)
        if str(values.dtype) != "float8_e4m3fn":
            raise HFCheckpointError(f"{self.where}: tensor {name!r} is {values.dtype}; an fp8 checkpoint stores the "
                                    "weights it scales as float8_e4m3fn")
        if hf_shape is not None and tuple(values.shape) != hf_shape:
            raise HFCheckpointError(f"{self.where}: tensor {name!r} has shape {tuple(values.shape)}, expected "
                                    f"{hf_shape} for this config")
        return BlockScaledArray(values, self._fp8_grid(name, values.shape, scale), "fp8", False,
                                tuple(values.shape[-2:]), self.quant.block)

    def _fp8_grid(self, name: str, shape: tuple[int, ...], scale: np.ndarray) -> np.ndarray:
        """The scale tensor as float32 [..., ceil(R/bo), ceil(C/bi)] (weight_block_size null: [..., 1, 1];
        a per-tensor `_scale` is spread over the block grid, so every fp8 tensor has the config's blocks)."""
        *lead, rows, cols = shape
        block = self.quant.block
        scale = np.asarray(scale, np.float32)
        grid = (*lead, 1, 1) if block is None else (*lead, -(-rows // block[0]), -(-cols // block[1]))
        if block is not None and not self.scale_of[name].endswith("_scale"):
            if tuple(scale.shape) != tuple(grid):
                raise HFCheckpointError(f"{self.where}: tensor {self.scale_of[name]!r} has shape "
                                        f"{tuple(scale.shape)}, expected {grid}: one scale per "
                                        f"{block[0]}x{block[1]} block of {name!r} {tuple(shape)} (the last block "
                                        "of an axis partial), by config.json's quantization_config.weight_block_size")
            return scale
        if scale.size == 1:
            return np.broadcast_to(scale.reshape(()), grid).copy()
        if scale.size == int(np.prod(lead)) and lead:
            return np.broadcast_to(scale.reshape(*lead, 1, 1), grid).copy()
        raise HFCheckpointError(f"{self.where}: tensor {self.scale_of[name]!r} has shape {tuple(scale.shape)}: "
                                f"with weight_block_size null it holds one scale per tensor "
                                f"(or per expert of {name!r} {tuple(shape)})")

    def kept(self, entry: Entry, root: tuple[str, ...] = ()) -> bool:
        """Whether `entry` is stored quantized and fills weights kept quantized in memory (module doc),
        its parts (gate and up of one fused tensor) each starting a block row (fp8: or all in one)."""
        if entry.hf_name not in self.scale_of:
            return False
        for path, _ in entry.targets:
            if path[:len(root) + 1] != (*root, "layers") or tuple(path[-2:]) not in QUANTIZED_WEIGHTS:
                return False
        parts = len(entry.targets)
        if parts == 1:
            return True
        if self.quant.method == "mxfp4":
            return entry.hf_shape[-2] % (parts * (MX_BLOCK if self.quant.block_axis == "output" else 1)) == 0
        block = self.quant.block
        return block is None or entry.hf_shape[-2] % (parts * block[0]) == 0 or entry.hf_shape[-2] <= block[0]

    def stored(self, entry: Entry) -> list[tuple[np.ndarray, np.ndarray]]:
        """(values, scales) per target of a kept entry: blocks of the stored matrix whose dequantized
        form, transposed when stored [out, in] (transposed_in_memory), is the target's [in, out] weight."""
        whole = self._stored(entry.hf_name, entry.hf_shape)
        parts = len(entry.targets)
        # the fused tensor's parts split its output axis: rows of an [out, in] matrix, columns of an [in, out] one
        axis = -2 if self.transposed_in_memory else -1
        values = np.split(whole.values, parts, axis=axis)
        scales = (np.split(whole.scales, parts, axis=axis) if whole.scales.shape[axis] > 1
                  else [whole.scales] * parts)
        return list(zip(values, scales))

    @property
    def transposed_in_memory(self) -> bool:
        """Whether the stored matrix is transformers' [out, in] (fp8; mxfp4 blocked along "input"), the
        transpose of our [in, out] weights; mxfp4 blocked along "output" is stored [in, out] already
        (the swap transformers' dequantizer makes)."""
        return self.quant.method == "fp8" or self.quant.block_axis == "input"
