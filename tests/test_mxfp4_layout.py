"""MXFP4 block axes (zaya_jax.checkpoints.hf_quantized, docs/fp8.md): the same expert weights written with
their 32-value blocks along the output axis (transformers' reading) and along the contraction axis
(MX kernels') load to the float checkpoint's model, the axis stated by quantization_config's
block_axis or, for a file that states none, chosen by load_hf's mxfp4_block_axis; the wrong reading
of configs/tiny.py's square down_proj [4, 64, 64] loads, and gives other weights.

The files are packed here from the OCP MX spec (e2m1 codes, low nibble first; e8m0 2^(s - 127)),
with one exponent per 32 x 32 tile so that both layouts hold the weights exactly."""

import numpy as np
import pytest

import zaya_jax
from tests.quantized_fixtures import requantize
from tests.test_cli_convert import NATIVE_FIELDS, TINY, convert
from zaya_jax.config_files import load_config_file, model_config
from zaya_jax.checkpoints.hf_config import HFCheckpointError
from zaya_jax.checkpoints.hf_load import read_hf_config
from zaya_jax.checkpoints.hf_quantized import QuantizedTensors, read_quantization
from zaya_jax.checkpoints.safetensors_io import TensorReader
from zaya_jax.errors import UserError
from zaya_jax.checkpoints.quantize import BlockScaledArray, dequantize_model
from zaya_jax.model.build import create_model
from zaya_jax.checkpoints.orbax_checkpoint import load_checkpoint_model

E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)
E2M1 = np.concatenate([E2M1, -E2M1])                      # code c: sign bit 3, magnitude E2M1[c & 7]
EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
DOWN = "model.layers.1.mlp.experts.down_proj"
IDS = np.random.default_rng(3).integers(3, 512, (2, 9))


def pack(codes: np.ndarray) -> np.ndarray:
    """uint8 e2m1 codes [E, X, Y] -> blocks [E, X, Y/32, 16], entry 2j in byte j's low nibble."""
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return np.ascontiguousarray(packed.reshape(*codes.shape[:-1], -1, 16), np.uint8)


def exact_experts(seed: int = 0):
    """{expert tensor name of the float export: (codes [E, out, in], tile exponents [E, out/32, in/32])}."""
    rng = np.random.default_rng(seed)

    def draw(tensor):
        e, out, inn = tensor.shape
        return rng.integers(0, 16, (e, out, inn), dtype=np.uint8), rng.integers(-6, -2, (e, out // 32, inn // 32))
    return draw


def weights(codes, tiles) -> np.ndarray:
    return E2M1[codes] * 2.0 ** np.repeat(np.repeat(tiles, 32, axis=1), 32, axis=2)


def stored(codes, tiles, axis: str) -> tuple[np.ndarray, np.ndarray]:
    """(blocks, scales) of [E, out, in]: "output" [E, in, out/32, 16] and [E, in, out/32], "input"
    [E, out, in/32, 16] and [E, out, in/32]."""
    if axis == "output":
        codes, tiles = codes.transpose(0, 2, 1), tiles.transpose(0, 2, 1)
    # contiguous: safetensors.numpy writes a strided array's memory in storage order
    return pack(codes), np.ascontiguousarray(127 + np.repeat(tiles, 32, axis=1), np.uint8)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """{name: HF directory}: "float" (the experts' exact values in float), "<axis> stated|unstated"
    (the experts in MXFP4 blocked along axis, quantization_config's block_axis set or absent) and
    "down input unstated" (only down_proj in MXFP4, blocked along the contraction axis)."""
    cfg = model_config(load_config_file(TINY)).replace(layout="native", **NATIVE_FIELDS)
    root = tmp_path_factory.mktemp("mxfp4_axes")
    zaya_jax.save_hf(create_model(cfg, seed=4), root / "source")
    draw, drawn = exact_experts(), {}
    for name in sorted(TensorReader(root / "source").names()):
        if name.endswith(EXPERTS):
            drawn[name] = draw(TensorReader(root / "source").get(name))
    out = {"float": requantize(root / "source", root / "float", None,
                               lambda n, t: {n: weights(*drawn[n])} if n in drawn else None)}
    skip = ["model.layers.*.self_attn", "model.layers.*.mlp.gate", "model.embed_tokens", "lm_head"]

    def blocked(axis, names):
        return lambda n, t: (dict(zip((n + "_blocks", n + "_scales"), stored(*drawn[n], axis))) if n in names
                             else {n: weights(*drawn[n])} if n in drawn else None)
    for axis in ("output", "input"):
        for stated in (True, False):
            config = {"quant_method": "mxfp4", "modules_to_not_convert": skip, **({"block_axis": axis} if stated else {})}
            key = f"{axis} {'stated' if stated else 'unstated'}"
            out[key] = requantize(root / "float", root / key.replace(" ", "_"), config, blocked(axis, set(drawn)))
    downs = {n for n in drawn if n.endswith("down_proj")}
    out["down input unstated"] = requantize(root / "float", root / "down_input", {"quant_method": "mxfp4"},
                                            blocked("input", downs))
    return out


def flat(model) -> dict:
    from flax import nnx
    return {path: np.asarray(v.get_value()) for path, v in nnx.to_flat_state(nnx.state(dequantize_model(model)))}


def block_axis_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if "block_axis" in line]


@pytest.mark.parametrize("case, option", [("output stated", None), ("input stated", None),
                                          ("output unstated", None), ("input unstated", "input"),
                                          ("output unstated", "output")])
def test_both_block_axes_load_the_float_checkpoints_model(files, capsys, case, option):
    reference = zaya_jax.load_hf(files["float"])
    capsys.readouterr()
    model = zaya_jax.load_hf(files[case], mxfp4_block_axis=option)
    lines = block_axis_lines(capsys.readouterr().err)
    if case == "output unstated" and option is None:   # transformers' reading, said once, naming the other
        assert len(lines) == 1 and "output axis as transformers does" in lines[0], lines
        assert "mxfp4_block_axis='input'" in lines[0] and "--mxfp4_block_axis=input" in lines[0]
    else:
        assert lines == []
    for name in ("gate", "up", "down"):
        assert isinstance(getattr(model.layers.moe, name).get_value(), BlockScaledArray), name
    ours, theirs = flat(model), flat(reference)
    assert ours.keys() == theirs.keys()
    for path in theirs:
        np.testing.assert_array_equal(ours[path], theirs[path], err_msg=str(path))
    np.testing.assert_allclose(np.asarray(model(IDS)), np.asarray(reference(IDS)), atol=1e-5, rtol=0)


@pytest.mark.parametrize("case", ["output stated", "input stated"])
def test_dequantizing_get_reads_each_axis(files, case):
    """QuantizedTensors.get (the dequantize-on-load path) of the square down_proj: the float tensor."""
    config = read_hf_config(files[case])
    reader = TensorReader(files[case])
    tensors = QuantizedTensors(read_quantization(config), reader.names(), reader.get, str(files[case]))
    np.testing.assert_array_equal(tensors.get(DOWN), TensorReader(files["float"]).get(DOWN))


def test_the_wrong_reading_of_a_square_down_proj_loads_other_weights(files, capsys):
    """A file blocked along the contraction axis that says nothing: read as transformers reads it, its
    square down_proj loads without complaint (the one note line) and is wrong; the option reads it right."""
    reference = flat(zaya_jax.load_hf(files["float"]))
    down = next(p for p in reference if p[-2:] == ("moe", "down"))
    wrong = flat(zaya_jax.load_hf(files["down input unstated"]))
    assert len(block_axis_lines(capsys.readouterr().err)) == 1
    assert wrong[down].shape == reference[down].shape
    assert not np.allclose(wrong[down], reference[down], atol=1e-3)
    right = flat(zaya_jax.load_hf(files["down input unstated"], mxfp4_block_axis="input"))
    np.testing.assert_array_equal(right[down], reference[down])


def test_a_non_square_tensor_read_along_the_wrong_axis_is_refused_naming_the_option(files):
    with pytest.raises(HFCheckpointError) as err:
        zaya_jax.load_hf(files["input stated"], mxfp4_block_axis="output")
    message = str(err.value)
    assert "gate_up_proj_blocks' has shape (4, 128, 2, 16), expected (4, 64, 4, 16)" in message
    assert "mxfp4_block_axis / --mxfp4_block_axis" in message


def test_a_block_axis_that_is_not_one_is_refused(files, tmp_path):
    bad = requantize(files["output stated"], tmp_path / "bad", {"quant_method": "mxfp4", "block_axis": "rows"},
                     lambda n, t: None)
    with pytest.raises(HFCheckpointError, match=r"block_axis='rows' is not a block axis.*'output', 'input'"):
        zaya_jax.load_hf(bad)
    with pytest.raises(UserError, match=r"mxfp4_block_axis='rows' is not a block axis"):
        zaya_jax.load_hf(files["output stated"], mxfp4_block_axis="rows")


def test_convert_to_orbax_passes_the_flag(files, tmp_path):
    """`convert to_orbax --mxfp4_block_axis input` of the unstated contraction-axis file: no note, the
    float checkpoint's experts."""
    done = convert("to_orbax", "--hf", files["input unstated"], "--out", tmp_path / "ckpt", "--mxfp4_block_axis", "input")
    assert done.returncode == 0, done.stderr[-3000:]
    assert block_axis_lines(done.stderr) == []
    model, _ = load_checkpoint_model(str(tmp_path / "ckpt"))
    reference = zaya_jax.load_hf(files["float"])
    for name in ("gate", "up", "down"):
        np.testing.assert_array_equal(np.asarray(getattr(model.layers.moe, name).get_value()),
                                      np.asarray(getattr(reference.layers.moe, name).get_value()), err_msg=name)
