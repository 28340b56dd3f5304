"""`convert to_hf --quantize fp8|mxfp4` (zaya_jax.checkpoints.quantized_export): FP8 quantized bit for bit
as transformers' own Fp8Quantize, MXFP4 by the MX rule, and the export loads in transformers (its
quantization_config parsed by its quantizer) with the logits our loader gives for the same files."""

import dataclasses
import json
import os

import numpy as np
import pytest

import zaya_jax
from tests.hf_reference import hf_logits
from tests.quantized_fixtures import numpy_fp8_to_torch
from tests.test_cli_convert import NATIVE_FIELDS, TINY, convert
from zaya_jax.config_files import load_config_file, model_config
from zaya_jax.checkpoints.quantized_export import fp8_blocks, mxfp4_blocks, quantized_tensors
from zaya_jax.checkpoints.quantize import BlockScaledArray
from zaya_jax.model.build import create_model
from zaya_jax.checkpoints.orbax_checkpoint import save_model
from zaya_jax.checkpoints.model_parts import ModelParts

IDS = np.random.default_rng(7).integers(3, 512, (2, 20))


@pytest.mark.torch_reference
@pytest.mark.parametrize("block", [(8, 16), (32, 48), (12, 20)])
def test_fp8_quantizes_as_transformers_bit_for_bit(block):
    """(12, 20) tiles neither axis of [3, 32, 48]: transformers' Fp8Quantize (which leaves such a weight in
    float) quantizes the weight padded with zeros to whole blocks (no block's max changes), cropped back."""
    import torch
    from transformers.integrations.finegrained_fp8 import Fp8Quantize
    from transformers.utils.quantization_config import FineGrainedFP8Config

    class Quantizer:
        quantization_config = FineGrainedFP8Config(weight_block_size=block)
    w = np.random.default_rng(0).normal(size=(3, 32, 48)).astype(np.float32) * np.logspace(-4, 1, 48, dtype=np.float32)
    w[0, :8, :16] = 0  # an all-zero block: scale 1
    padded = np.pad(w, [(0, 0), (0, -w.shape[1] % block[0]), (0, -w.shape[2] % block[1])])
    theirs = Fp8Quantize(Quantizer())._quantize_one("experts.down_proj", torch.from_numpy(padded))
    values, scale_inv = fp8_blocks(w, block)
    np.testing.assert_array_equal(numpy_fp8_to_torch(values).view(torch.uint8).numpy(),
                                  theirs["experts.down_proj"].view(torch.uint8).numpy()[:, :32, :48])
    np.testing.assert_array_equal(scale_inv.view(np.uint32), theirs["experts.down_proj_scale_inv"].numpy().view(np.uint32))


def test_mxfp4_takes_the_smallest_exponent_that_holds_each_block_and_rounds_to_the_nearest():
    """Each 32 values along the stored axis share 2^X, X the smallest with max|w| / 2^X <= 6 (the
    triton kernels' ROUND_UP); each value is the e2m1 multiple of 2^X nearest to it."""
    rng = np.random.default_rng(1)
    w = (rng.normal(size=(2, 64, 8)) * np.logspace(-3, 2, 8)).astype(np.float32)   # [E, A, B]: blocks along A
    blocks, scales = mxfp4_blocks(w)
    assert blocks.shape == (2, 8, 2, 16) and scales.shape == (2, 8, 2)
    x = scales.astype(np.int32) - 127
    peak = np.abs(np.swapaxes(w, 1, 2).reshape(2, 8, 2, 32)).max(axis=-1)
    assert np.all(peak / 2.0 ** x <= 6) and np.all(peak / 2.0 ** (x - 1) > 6)
    got = np.swapaxes(np.asarray(BlockScaledArray(blocks.reshape(2, 8, 32), scales, "mxfp4", True, (64, 8))[...]), 1, 2)
    grid = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6])
    unit = 2.0 ** np.repeat(x, 32, axis=-1).reshape(2, 8, 64)
    nearest = np.abs(np.abs(np.swapaxes(w, 1, 2))[..., None] / unit[..., None] - grid).min(axis=-1) * unit
    np.testing.assert_allclose(np.abs(got - np.swapaxes(w, 1, 2)), nearest, rtol=0, atol=1e-6 * np.abs(w).max())


def test_an_fp8_export_with_no_attention_or_expert_tensor_is_refused():
    """quantized_tensors writes every tensor it is given; with no attention projection or expert among
    them (what fp8 quantizes) it ends in UserError rather than a quantized-format checkpoint without one."""
    from zaya_jax.errors import UserError
    tensors = [("model.embed_tokens.weight", np.ones((8, 4), np.float32)),
               ("model.layers.0.mlp.gate.down_proj.weight", np.ones((4, 4), np.float32))]
    dequantized = {}
    written = []
    with pytest.raises(UserError, match=r"--quantize fp8: no tensor of this model would be quantized \(fp8 quantizes "
                                        r"the attention projections and experts"):
        written.extend(quantized_tensors(tensors, "fp8", 16, dequantized))
    assert [name for name, _ in written] == [name for name, _ in tensors] and not dequantized


@pytest.fixture(scope="module")
def native_checkpoint(tmp_path_factory):
    """configs/tiny.py's model, native layout, random, as a model-only checkpoint."""
    cfg = model_config(load_config_file(TINY)).replace(layout="native", **NATIVE_FIELDS)
    model = create_model(cfg, seed=5)
    directory = tmp_path_factory.mktemp("native") / "ckpt"
    params, biases = ModelParts.arrays(model)
    save_model(str(directory), params, biases, {"model": dataclasses.asdict(cfg)})
    return directory


@pytest.mark.torch_reference
@pytest.mark.parametrize("block", [24, 100])
def test_to_hf_fp8_with_blocks_that_do_not_tile_loads_in_transformers_fp8_modules(native_checkpoint, tmp_path, block):
    """--fp8_block 24 and 100 tile none of the tiny model's quantized matrices (rows 16, 32, 64, 128; columns
    64): each is written with partial last blocks, transformers' FP8Linear / FP8Experts take the files
    (tests/quantized_fixtures.transformers_fp8_model) and compute our loader's logits."""
    from tests.quantized_fixtures import transformers_fp8_model
    from zaya_jax.checkpoints.safetensors_io import TensorReader
    out = tmp_path / "hf"
    done = convert("to_hf", "--checkpoint", native_checkpoint, "--out", out, "--quantize", "fp8",
                   "--fp8_block", block)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "fp8: 14 tensors quantized" in done.stderr, done.stderr[-2000:]   # 2 layers x (5 attention + 2 experts)
    reader = TensorReader(out)
    grid = reader.get("model.layers.0.mlp.experts.gate_up_proj_scale_inv").shape
    assert grid == (4, -(-128 // block), -(-64 // block))  # [E, 2 x 64 rows, 64 columns] in blocks, the last partial
    ours = zaya_jax.load_hf(out)
    assert isinstance(ours.layers.attention.k_proj.get_value(), BlockScaledArray)
    np.testing.assert_allclose(np.asarray(ours(IDS)), hf_logits(transformers_fp8_model(out), IDS), atol=1e-4, rtol=0)


@pytest.mark.torch_reference
@pytest.mark.parametrize("method", ["fp8", "mxfp4"])
def test_to_hf_quantize_writes_what_transformers_loads_with_our_logits(native_checkpoint, tmp_path, method):
    """transformers parses the quantization_config with its own quantizer (FineGrainedFP8Config /
    Mxfp4Config) and loads the files on CPU through its dequantize path; for fp8 that path leaves the
    experts' scales unread (tests/test_hf_quantized.py), so its experts are set from its Fp8Dequantize."""
    import torch
    from transformers import ZayaForCausalLM
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize
    from transformers.utils.quantization_config import FineGrainedFP8Config, Mxfp4Config
    from zaya_jax.checkpoints.safetensors_io import TensorReader
    out = tmp_path / "hf"
    done = convert("to_hf", "--checkpoint", native_checkpoint, "--out", out, "--quantize", method, "--fp8_block", "16")
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"{method}: " in done.stderr and "tensors quantized" in done.stderr
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    parsed = (FineGrainedFP8Config if method == "fp8" else Mxfp4Config).from_dict(config)
    reference = ZayaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    reader = TensorReader(out)
    names = reader.names()
    if method == "fp8":
        assert parsed.weight_block_size == [16, 16] and "model.layers.0.self_attn.o_proj.weight_scale_inv" in names
        with torch.no_grad():
            for name, param in reference.named_parameters():
                if name + "_scale_inv" in names and name.endswith(("gate_up_proj", "down_proj")):
                    param.copy_(Fp8Dequantize(None)._dequantize_one(
                        numpy_fp8_to_torch(reader.get(name)), torch.from_numpy(reader.get(name + "_scale_inv")),
                        output_dtype=torch.float32))
    else:
        assert "model.layers.1.mlp.experts.down_proj_blocks" in names and "model.layers.0.self_attn.o_proj.weight" in names
    assert not any(n.startswith(("model.embed_tokens.", "model.layers.0.mlp.gate.")) and "scale" in n and "states" not in n
                   for n in names)
    ours = zaya_jax.load_hf(out)
    assert isinstance(ours.layers.moe.down.get_value(), BlockScaledArray)
    np.testing.assert_allclose(np.asarray(ours(IDS)), hf_logits(reference, IDS), atol=1e-4, rtol=0)
    assert os.path.isfile(out / "model.safetensors")


@pytest.mark.torch_reference
@pytest.mark.parametrize("method", ["fp8", "mxfp4"])
def test_a_zaya1_vl_exports_quantized_text_weights_and_a_float_vision_tower(tmp_path, method):
    """save_vl_hf(quantize=...): the text model's attention (fp8) or experts (both) quantized, FP8 bit for
    bit as transformers' Fp8Quantize makes them from the float export's tensors; the vision tower,
    merger and vision LoRA written in float exactly as the float export writes them, and named in
    modules_to_not_convert; read back with those weights kept quantized (the logits check runs on write)."""
    from tests.quantized_fixtures import transformers_fp8
    from tests.vision_fixtures import TEXT, random_vl_model
    from zaya_jax.checkpoints.hf_vl import load_vl_hf, save_vl_hf
    from zaya_jax.checkpoints.safetensors_io import TensorReader
    source = random_vl_model(TEXT.replace(moe_intermediate_size=32))
    save_vl_hf(source, tmp_path / "float")
    lines = []
    save_vl_hf(source, tmp_path / method, quantize=method, block=8, report=lines.append)
    assert lines[-1].endswith("tensors quantized") and "holding the" in lines[-1]
    config = json.loads((tmp_path / method / "config.json").read_text())["quantization_config"]
    assert "model.visual" in config["modules_to_not_convert"]
    floats, written = TensorReader(tmp_path / "float"), TensorReader(tmp_path / method)
    kept = [n for n in floats.names() if "language_model" not in n or "_lora_" in n]
    assert kept and all(n in written.names() and np.array_equal(written.get(n), floats.get(n)) for n in kept)
    model = load_vl_hf(tmp_path / method)
    assert isinstance(model.text.layers.moe.down.get_value(), BlockScaledArray)
    if method == "fp8":
        assert isinstance(model.text.layers.attention.q_proj.get_value(), BlockScaledArray)
        reference = transformers_fp8((8, 8))
        name = next(n for n in floats.names() if n.endswith("self_attn.qkv_proj.q_proj.weight"))
        theirs = reference(name, floats.get(name))
        np.testing.assert_array_equal(written.get(name).view(np.uint8), theirs[name].view(np.uint8))
        np.testing.assert_array_equal(written.get(name + "_scale_inv"), theirs[name + "_scale_inv"])
