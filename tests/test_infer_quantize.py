"""Weight-only int8 / int4 quantization: packing, error bounds, memory, model quality, loading."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import zaya_jax
from tests.hf_reference import jax_from_hf, make_hf_model
from zaya_jax.infer import QuantizedArray, load_hf, param_bytes, quantize_model
from zaya_jax.checkpoints.quantize import pack_int4, quantize_array, rows, unpack_int4


@pytest.fixture(scope="module")
def model():
    return jax_from_hf(make_hf_model(seed=0))


def test_int4_packing_round_trips_and_halves_the_bytes():
    ints = jnp.asarray(np.random.default_rng(0).integers(-8, 8, (3, 8, 5)), jnp.int8)
    packed = pack_int4(ints, axis=-2)
    assert packed.shape == (3, 4, 5) and packed.dtype == jnp.uint8
    np.testing.assert_array_equal(unpack_int4(packed, axis=-2), ints)


@pytest.mark.parametrize("bits, qmax", [(8, 127), (4, 7)])
def test_error_is_at_most_half_a_step_per_group(bits, qmax):
    w = jax.random.normal(jax.random.key(0), (2, 64, 6)) * jnp.linspace(0.1, 3.0, 64)[:, None]
    q = quantize_array(w, bits, group_size=16, axis=-2)
    assert q.shape == w.shape and q.scales.shape == (2, 4, 6)
    assert q.values.dtype == (jnp.int8 if bits == 8 else jnp.uint8)
    assert q.values.size == w.size * bits // 8
    step = jnp.repeat(q.scales, 16, axis=1)
    assert bool(jnp.all(jnp.abs(q[...] - w) <= step / 2 + 1e-6))
    np.testing.assert_allclose(q.scales, jnp.max(jnp.abs(w.reshape(2, 4, 16, 6)), axis=2) / qmax, rtol=1e-6)


def test_rows_gather_integers_before_dequantizing():
    w = jax.random.normal(jax.random.key(1), (4, 32, 8))
    param = nnx.Param(quantize_array(w, 4, group_size=8, axis=-2))
    index = jnp.array([[3, 0], [3, 2]])
    np.testing.assert_array_equal(rows(param, index, jnp.float32), param[...][index])
    assert isinstance(param.get_value().take(index), QuantizedArray)


@pytest.mark.torch_reference
def test_quantized_models_are_smaller_and_close(model):
    ids = np.random.default_rng(0).integers(3, 97, (2, 16))
    ref = jax.nn.log_softmax(model(ids))
    sizes, kls = {}, {}
    for mode in ("int8", "int4"):
        quantized = quantize_model(model, mode, group_size=8)
        assert isinstance(quantized.layers.moe.gate.get_value(), QuantizedArray)
        assert isinstance(quantized.layers.attention.o_proj.get_value(), QuantizedArray)
        assert not isinstance(quantized.embed.get_value(), QuantizedArray)
        sizes[mode] = param_bytes(quantized)
        logp = jax.nn.log_softmax(quantized(ids))
        kls[mode] = float(jnp.mean(jnp.sum(jnp.exp(ref) * (ref - logp), axis=-1)))
    assert param_bytes(model) > sizes["int8"] > sizes["int4"]
    assert kls["int8"] < 1e-3 and kls["int8"] < kls["int4"] < 0.5, kls
    assert not isinstance(model.layers.moe.gate.get_value(), QuantizedArray)  # the input is left alone


@pytest.mark.torch_reference
def test_load_hf_quantizes_at_load_time(model, tmp_path):
    zaya_jax.save_hf(model, tmp_path / "ckpt")
    quantized = load_hf(tmp_path / "ckpt", quantize="int8", group_size=16)
    assert quantized.layers.moe.down.get_value().bits == 8
    assert param_bytes(quantized) < param_bytes(model)


@pytest.mark.torch_reference
def test_bad_quantization_settings_fail_clearly(model):
    with pytest.raises(ValueError, match="choose one of"):
        quantize_model(model, "int3")
    message = r"layers\.attention\.\w+_proj: input axis of length 32 does not split into groups of 24"
    with pytest.raises(ValueError, match=message):
        quantize_model(model, "int8", group_size=24)
