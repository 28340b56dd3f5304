"""Quantized HF checkpoints in (zaya_jax.checkpoints.hf_quantized): transformers' FP8 and MXFP4 layouts
dequantize bit for bit as transformers' own dequantizers do, load with the experts and attention
kept in their precision, and compute transformers' logits; ZAYA1-VL loads them too."""

import numpy as np
import pytest

import zaya_jax
from tests.hf_reference import hf_logits, make_hf_model
from tests.quantized_fixtures import (NOT_CONVERTED, numpy_fp8_to_torch, random_fp8, random_mxfp4, requantize,
                                      transformers_fp8, transformers_fp8_model)
from zaya_jax.checkpoints.quantize import BlockScaledArray, param_bytes

pytestmark = pytest.mark.torch_reference
IDS = np.random.default_rng(0).integers(3, 97, (2, 12))


def fp8_codes(rng, shape):
    """Random float8_e4m3fn values: every byte but the two NaNs (0x7f, 0xff)."""
    import ml_dtypes
    codes = rng.integers(0, 254, shape, dtype=np.uint8)
    return np.where(codes >= 0x7F, codes + 1, codes).astype(np.uint8).view(ml_dtypes.float8_e4m3fn)


@pytest.mark.parametrize("shape, grid", [((3, 32, 48), (3, 4, 3)), ((16, 24), (2, 3)), ((2, 16, 8), (2, 1, 1))])
def test_fp8_dequantizes_as_transformers_bit_for_bit(shape, grid):
    import torch
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize
    rng = np.random.default_rng(1)
    values = fp8_codes(rng, shape)
    scales = rng.lognormal(-6, 3, grid).astype(np.float32)
    ours = np.asarray(BlockScaledArray(values, scales, "fp8", False, shape[-2:])[...])
    theirs = Fp8Dequantize(None)._dequantize_one(numpy_fp8_to_torch(values), torch.from_numpy(scales),
                                                 output_dtype=torch.float32).numpy()
    np.testing.assert_array_equal(ours.view(np.uint32), theirs.view(np.uint32))


@pytest.mark.parametrize("shape, block", [((3, 40, 50), (16, 24)), ((20, 8), (16, 32))])
def test_fp8_partial_blocks_dequantize_as_transformers_fp8_linear_bit_for_bit(shape, block):
    """Blocks that do not tile the matrix: a [..., ceil(R/br), ceil(C/bc)] grid, the last block of each
    axis partial, read as transformers' FP8Linear reads it (`_dequantize_fp8_weight`, its backward's)."""
    import torch
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight
    rng = np.random.default_rng(4)
    values = fp8_codes(rng, shape)
    scales = rng.lognormal(-6, 3, (*shape[:-2], -(-shape[-2] // block[0]), -(-shape[-1] // block[1]))).astype(np.float32)
    ours = np.asarray(BlockScaledArray(values, scales, "fp8", False, shape[-2:], block)[...])
    theirs = _dequantize_fp8_weight(numpy_fp8_to_torch(values), torch.from_numpy(scales), list(block),
                                    torch.float32).numpy()
    np.testing.assert_array_equal(ours.view(np.uint32), theirs.view(np.uint32))


def test_mxfp4_dequantizes_as_transformers_bit_for_bit():
    """Every e2m1 code, every e8m0 exponent from 2 to 255 (0 and 1 give subnormal floats, which XLA on
    CPU flushes to zero and torch keeps: a weight of 2^-127 is not one a checkpoint holds)."""
    import torch
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    rng = np.random.default_rng(2)
    blocks = rng.integers(0, 256, (2, 24, 3, 16), dtype=np.uint8)
    scales = rng.integers(2, 256, (2, 24, 3), dtype=np.uint8)
    scales[0, 0] = [2, 127, 255]
    ours = np.asarray(BlockScaledArray(blocks.reshape(2, 24, 48), scales, "mxfp4", True, (96, 24))[...])
    theirs = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32)
    np.testing.assert_array_equal(ours.view(np.uint32), theirs.numpy().view(np.uint32))


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory):
    """A random tiny transformers ZAYA (moe_intermediate_size 32, so that MXFP4's 32-value blocks tile
    its experts) saved with save_pretrained, and the model."""
    model = make_hf_model(seed=3, moe_intermediate_size=32)
    directory = tmp_path_factory.mktemp("float")
    model.save_pretrained(directory)
    return directory, model


def kept_weights(model) -> dict:
    return {name: model.layers.attention.q_proj.get_value() if name == "q_proj" else getattr(
        model.layers.moe, name).get_value() for name in ("q_proj", "gate", "up", "down")}


@pytest.mark.parametrize("block", [(8, 16), None])
def test_fp8_checkpoint_logits_match_transformers(float_dir, tmp_path, block):
    """transformers' own Fp8Quantize writes the checkpoint (attention and experts; router, norms,
    convolutions, embedding in float); transformers loads it on CPU through its dequantize path. That
    path dequantizes ZAYA's linears but reads the experts' fp8 values without their `_scale_inv` (it
    reports them unexpected: its dequantizer converts `.weight` parameters only; on a GPU its FP8Experts
    read them), so the reference's experts are set from transformers' Fp8Dequantize of the stored tensors."""
    import torch
    from transformers import ZayaForCausalLM
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize
    from zaya_jax.checkpoints.safetensors_io import TensorReader
    src, _ = float_dir
    config = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": block and list(block),
              "modules_to_not_convert": NOT_CONVERTED}
    directory = requantize(src, tmp_path / "fp8", config, transformers_fp8(block))
    reference = ZayaForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    reader = TensorReader(directory)
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                param.copy_(Fp8Dequantize(None)._dequantize_one(
                    numpy_fp8_to_torch(reader.get(name)), torch.from_numpy(reader.get(name + "_scale_inv")),
                    output_dtype=torch.float32))
    model = zaya_jax.load_hf(directory)
    for name, weight in kept_weights(model).items():
        assert isinstance(weight, BlockScaledArray) and str(weight.values.dtype) == "float8_e4m3fn", name
    assert not isinstance(model.layers.moe.router.fc1.get_value(), BlockScaledArray)
    np.testing.assert_allclose(np.asarray(model(IDS)), hf_logits(reference, IDS), atol=1e-4, rtol=0)


def test_fp8_checkpoint_with_partial_blocks_logits_match_transformers_fp8_modules(float_dir, tmp_path):
    """weight_block_size [12, 20] tiles none of the quantized matrices (rows 8, 16, 32, 64; columns 32):
    each has a partial last block on both axes, random values and a random scale per block. transformers
    loads it into its FP8Linear / FP8Experts (the scale grids they allocate) and reads the weights with
    its FP8 dequantizer (tests/quantized_fixtures.transformers_fp8_model)."""
    block = (12, 20)
    config = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": list(block),
              "modules_to_not_convert": NOT_CONVERTED}
    directory = requantize(float_dir[0], tmp_path / "fp8", config, random_fp8(block, seed=5))
    reference = transformers_fp8_model(directory)
    model = zaya_jax.load_hf(directory)
    for name in ("q_proj", "down"):   # gate and up share a block row (64 rows: 12 does not split them), so float
        weight = kept_weights(model)[name]
        assert isinstance(weight, BlockScaledArray) and weight.block == block, name
    theirs = hf_logits(reference, IDS)
    assert np.isfinite(theirs).all() and np.std(theirs) > 0.1
    np.testing.assert_allclose(np.asarray(model(IDS)), theirs, atol=1e-4, rtol=0)


def test_mxfp4_checkpoint_logits_match_transformers_and_take_a_quarter_of_bf16(float_dir, tmp_path):
    """The experts as MXFP4 blocks in gpt-oss's layout; transformers loads the checkpoint on CPU with
    its Mxfp4 dequantize path (Mxfp4Dequantize, convert_moe_packed_tensors), its whole loading."""
    import torch
    from transformers import ZayaForCausalLM
    src, _ = float_dir
    directory = requantize(src, tmp_path / "mxfp4", {"quant_method": "mxfp4", "modules_to_not_convert": NOT_CONVERTED},
                           random_mxfp4())
    reference = ZayaForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    model = zaya_jax.load_hf(directory)
    weights = kept_weights(model)
    for name in ("gate", "up", "down"):
        assert isinstance(weights[name], BlockScaledArray) and weights[name].values.dtype == np.uint8
    experts = sum(weights[n].values.nbytes + weights[n].scales.nbytes for n in ("gate", "up", "down"))
    bf16 = 2 * sum(int(np.prod(weights[n].shape)) for n in ("gate", "up", "down"))
    assert experts / bf16 == pytest.approx((0.5 + 1 / 32) / 2)     # 4.25 bits of 16
    assert param_bytes(model) < param_bytes(zaya_jax.load_hf(src))
    np.testing.assert_allclose(np.asarray(model(IDS)), hf_logits(reference, IDS), atol=1e-4, rtol=0)


def test_mxfp4_experts_dequantized_on_load_match_transformers(tmp_path):
    """moe_intermediate_size 16: gate_up_proj [E, 32, 32] (square) is one 32-value block along its output
    axis, so its gate and up halves are no whole blocks and QuantizedTensors.get dequantizes it on load
    (down_proj stays quantized); transformers loads the same file on CPU through its Mxfp4 dequantize path."""
    import torch
    from transformers import ZayaForCausalLM
    from zaya_jax.checkpoints.safetensors_io import TensorReader
    make_hf_model(seed=5, moe_intermediate_size=16).save_pretrained(tmp_path / "float")
    directory = requantize(tmp_path / "float", tmp_path / "mxfp4",
                           {"quant_method": "mxfp4", "modules_to_not_convert": NOT_CONVERTED}, random_mxfp4(seed=4))
    assert TensorReader(directory).get("model.layers.1.mlp.experts.gate_up_proj_blocks").shape == (4, 32, 1, 16)
    reference = ZayaForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    model = zaya_jax.load_hf(directory)
    weights = kept_weights(model)
    assert not isinstance(weights["gate"], BlockScaledArray) and not isinstance(weights["up"], BlockScaledArray)
    assert isinstance(weights["down"], BlockScaledArray)
    np.testing.assert_allclose(np.asarray(model(IDS)), hf_logits(reference, IDS), atol=1e-4, rtol=0)


def transformers_dequantized(directory) -> dict:
    """{weight name: float32} for every quantized tensor of `directory`, by transformers' dequantizers."""
    import torch
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    from zaya_jax.checkpoints.safetensors_io import TensorReader
    reader, out = TensorReader(directory), {}
    for name in reader.names():
        if name.endswith("_scale_inv"):
            weight = name[:-len("_scale_inv")]
            out[weight] = Fp8Dequantize(None)._dequantize_one(numpy_fp8_to_torch(reader.get(weight)),
                                                              torch.from_numpy(reader.get(name)),
                                                              output_dtype=torch.float32).numpy()
        elif name.endswith("_blocks"):
            weight = name[:-len("_blocks")]
            out[weight] = convert_moe_packed_tensors(torch.from_numpy(reader.get(name)),
                                                     torch.from_numpy(reader.get(weight + "_scales")),
                                                     dtype=torch.float32).numpy()
    return out


@pytest.mark.parametrize("kind", ["fp8", "mxfp4"])
def test_quantized_zaya1_vl_loads_with_the_dequantized_checkpoints_logits(tmp_path, kind):
    """A zaya1_vl checkpoint (save_vl_hf of a random ZayaVL) with its text model's attention in FP8
    (transformers' Fp8Quantize) or its experts in MXFP4 loads with those kept quantized and gives the
    logits (probe batch with an image) of the float checkpoint holding transformers' dequantization
    of the same tensors."""
    from flax import nnx

    from tests.vision_fixtures import TEXT, random_vl_model
    from zaya_jax.checkpoints.hf_vl import _probe, load_vl_hf, save_vl_hf
    source = random_vl_model(TEXT.replace(moe_intermediate_size=32))
    save_vl_hf(source, tmp_path / "float")
    if kind == "fp8":
        fp8 = transformers_fp8((8, 8))
        config = {"quant_method": "fp8", "weight_block_size": [8, 8]}
        quantized = requantize(tmp_path / "float", tmp_path / kind, config,
                               lambda n, t: fp8(n, t) if "language_model" in n and ".self_attn." in n else None)
    else:
        mx = random_mxfp4()
        quantized = requantize(tmp_path / "float", tmp_path / kind, {"quant_method": "mxfp4"},
                               lambda n, t: mx(n, t) if "language_model" in n else None)
    dequantized = transformers_dequantized(quantized)
    reference = requantize(tmp_path / "float", tmp_path / "reference", None,
                           lambda n, t: {n: dequantized[n]} if n in dequantized else None)
    model = load_vl_hf(quantized)
    weight = model.text.layers.attention.q_proj if kind == "fp8" else model.text.layers.moe.down
    assert isinstance(weight.get_value(), BlockScaledArray)
    ids, images = _probe(source)
    forward = nnx.jit(lambda m, x, im: m(x, im))
    np.testing.assert_allclose(np.asarray(forward(model, ids, images)),
                               np.asarray(forward(load_vl_hf(reference), ids, images)), atol=1e-5, rtol=0)
