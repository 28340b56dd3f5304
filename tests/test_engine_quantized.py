"""The engine serves int8/int4 weights (zaya_jax.checkpoints.quantize) and a quantized checkpoint's FP8 /
MXFP4 weights (zaya_jax.checkpoints.hf_quantized) as generate does: a mixed load on a quantized model
gives each request the tokens generate gives it alone on that same quantized model; generate on the
quantized weights (gathered before dequantizing) gives the tokens of the same values in float."""

import numpy as np
import pytest

import zaya_jax
from tests.model_fixtures import random_tiny_model
from tests.test_engine_serving import MIXED, drain, submit
from zaya_jax.engine import Engine, SamplingParams
from zaya_jax.infer import quantize_model
from zaya_jax.checkpoints.quantize import BlockScaledArray, QuantizedArray, dequantize_model
from zaya_jax.engine import generate

LENGTHS = [3, 12, 7]


def assert_engine_equals_generate_alone(model) -> None:
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, model.config.vocab_size, n).tolist() for n in LENGTHS]
    engine = Engine(model, slots=2, cache_size=32, chunk=8)
    queues = [submit(engine, prompts[0], SamplingParams(max_tokens=6))]
    engine.step()
    queues += [submit(engine, p, SamplingParams(max_tokens=6)) for p in prompts[1:]]
    while engine.has_work():
        engine.step()
    for prompt, events in zip(prompts, queues):
        finished, _ = drain(events)
        alone = generate(model, [prompt], 6)[0].tolist()
        assert finished.tokens == alone[:len(finished.tokens)] and len(finished.tokens) >= 1


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_engine_equals_quantized_generate_alone(mode):
    model = quantize_model(random_tiny_model(**MIXED), mode, 16)
    assert isinstance(model.layers.moe.gate.get_value(), QuantizedArray)  # the weights served are the quantized ones
    assert_engine_equals_generate_alone(model)


@pytest.mark.parametrize("method", ["fp8", "mxfp4"])
def test_a_quantized_checkpoint_is_served_and_generated_from_its_quantized_weights(tmp_path, method):
    source = random_tiny_model(moe_intermediate_size=32, layout="native", router_norm_eps=1e-5, residual_in_fp32=True,
                               **MIXED)
    zaya_jax.save_hf(source, tmp_path / method, quantize=method, block=8)
    model = zaya_jax.load_hf(tmp_path / method)
    assert isinstance(model.layers.moe.gate.get_value(), BlockScaledArray)
    assert_engine_equals_generate_alone(model)
    prompts = np.random.default_rng(3).integers(3, model.config.vocab_size, (2, 9))
    np.testing.assert_array_equal(generate(model, prompts, 8), generate(dequantize_model(model),
                                                                                           prompts, 8))
