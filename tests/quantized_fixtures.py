"""Quantized HF checkpoints in transformers' layouts, made from a float one, for the tests of
zaya_jax.checkpoints.hf_quantized: `requantize` rewrites chosen tensors of an HF directory (FP8 through
transformers' own quantizer op, MXFP4 blocks drawn at random, since transformers quantizes MXFP4 only
with GPU kernels; `random_fp8` any block grid, partial blocks included, which Fp8Quantize does not
write), numpy-only helpers write broken ones for the CLI error tests; `transformers_fp8_model` loads an
fp8 one with transformers' FP8 modules."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from zaya_jax.checkpoints.safetensors_io import TensorReader

# transformers' ZAYA linears FineGrainedFP8 converts (nn.Linear outside modules_to_not_convert) and experts
ATTENTION = ("q_proj.weight", "k_proj.weight", "v_proj_current.weight", "v_proj_delayed.weight", "o_proj.weight")
EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
NOT_CONVERTED = ["lm_head", "model.layers.*.mlp.gate"]   # the router's linears stay in float


def requantize(src: str | Path, dst: str | Path, quantization_config: dict | None,
               rewrite: Callable[[str, np.ndarray], dict[str, np.ndarray] | None]) -> Path:
    """dst: src's files with each tensor `rewrite(name, float32 array)` returns tensors for (None: kept
    as is) replaced by those, and config.json's quantization_config set (None: left out)."""
    dst = Path(dst)
    shutil.copytree(src, dst)
    for old in dst.glob("*.safetensors*"):
        old.unlink()
    reader = TensorReader(src)
    tensors = {}
    for name in sorted(reader.names()):
        tensor = reader.get(name)
        replaced = rewrite(name, tensor)
        tensors.update({name: tensor} if replaced is None else replaced)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def torch_fp8_to_numpy(tensor) -> np.ndarray:
    import torch
    return tensor.contiguous().view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)


def numpy_fp8_to_torch(array: np.ndarray):
    import torch
    return torch.from_numpy(np.array(array).view(np.uint8)).view(torch.float8_e4m3fn)


def transformers_fp8(block: tuple[int, int] | None, names: tuple[str, ...] = ATTENTION + EXPERTS):
    """A rewrite quantizing the tensors whose names end with one of `names` by transformers' own
    Fp8Quantize op (integrations/finegrained_fp8.py), with FineGrainedFP8Config(weight_block_size=block)."""
    import torch
    from transformers.integrations.finegrained_fp8 import Fp8Quantize
    from transformers.utils.quantization_config import FineGrainedFP8Config

    class Quantizer:  # what Fp8Quantize reads of its HfQuantizer
        quantization_config = FineGrainedFP8Config(weight_block_size=block)

    op = Fp8Quantize(Quantizer())

    def rewrite(name, tensor):
        if not name.endswith(names):
            return None
        out = op.convert({name: torch.from_numpy(np.asarray(tensor, np.float32))})
        return {k: torch_fp8_to_numpy(v) if v.dtype == torch.float8_e4m3fn else v.numpy() for k, v in out.items()}
    return rewrite


def random_fp8(block: tuple[int, int], seed: int = 0, names: tuple[str, ...] = ATTENTION + EXPERTS):
    """A rewrite storing each tensor whose name ends with one of `names`, [..., out, in], as random
    float8_e4m3fn codes (any byte but the NaNs) and random float32 scales, one per `block` on the
    [..., ceil(out/bo), ceil(in/bi)] grid (the last block of an axis partial), each near 2^-10."""
    rng = np.random.default_rng(seed)

    def rewrite(name, tensor):
        if not name.endswith(names):
            return None
        codes = rng.integers(0, 254, tensor.shape, dtype=np.uint8)
        values = np.where(codes >= 0x7F, codes + 1, codes).astype(np.uint8).view(ml_dtypes.float8_e4m3fn)
        grid = (*tensor.shape[:-2], -(-tensor.shape[-2] // block[0]), -(-tensor.shape[-1] // block[1]))
        scale = rng.lognormal(np.log(2.0 ** -10), 0.7, grid).astype(np.float32)
        return {name: values, (name[:-len(".weight")] + ".weight_scale_inv" if name.endswith(".weight")
                               else name + "_scale_inv"): scale}
    return rewrite


def random_mxfp4(seed: int = 0, names: tuple[str, ...] = EXPERTS):
    """A rewrite storing each expert tensor [E, A, B] as random mxfp4 `_blocks` [E, B, A/32, 16] and
    `_scales` [E, B, A/32] (exponents 2^-6 .. 2^-4: values of at most 6 / 16)."""
    rng = np.random.default_rng(seed)

    def rewrite(name, tensor):
        if not name.endswith(names):
            return None
        e, a, b = tensor.shape
        return {name + "_blocks": rng.integers(0, 256, (e, b, a // 32, 16), dtype=np.uint8),
                name + "_scales": rng.integers(121, 124, (e, b, a // 32), dtype=np.uint8)}
    return rewrite


def transformers_fp8_model(directory: str | Path):
    """transformers' ZayaForCausalLM loaded from an fp8 checkpoint as on a GPU (its FineGrainedFP8 quantizer
    swaps in FP8Linear / FP8Experts, which allocate `ceil(out/bo) x ceil(in/bi)` scale grids and take the
    stored values and scales; the quantizer's no-GPU check is skipped, the CPU path dequantizes only
    tiling blocks), then every fp8 weight replaced by transformers' `_dequantize_fp8_weight` of it (what
    FP8Linear's backward reads the weight as, partial last blocks included), so its float forward runs
    (experts_implementation "eager": FP8Experts.forward, whose linears take the float weights)."""
    from unittest import mock

    import torch
    from transformers import ZayaForCausalLM
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    with mock.patch.object(FineGrainedFP8HfQuantizer, "validate_environment", lambda self, *args, **kwargs: None):
        model, info = ZayaForCausalLM.from_pretrained(directory, dtype=torch.float32, output_loading_info=True,
                                                      experts_implementation="eager")
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    converted = 0
    for module in model.modules():
        for name, scale in list(module.named_parameters(recurse=False)):
            if name.endswith("scale_inv"):
                weight = name[:-len("_scale_inv")] if name != "weight_scale_inv" else "weight"
                floats = _dequantize_fp8_weight(getattr(module, weight), scale, module.block_size, torch.float32)
                setattr(module, weight, torch.nn.Parameter(floats, requires_grad=False))
                converted += 1
    assert converted, "no fp8 weight loaded"
    return model.eval()
