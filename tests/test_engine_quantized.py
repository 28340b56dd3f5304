"""The engine serves int8/int4 weights (zaya_jax.infer.quantize) as generate does: a mixed load on a
quantized model gives each request the tokens generate gives it alone on that same quantized model."""

import numpy as np
import pytest

import zaya_jax
from tests.model_fixtures import random_tiny_model
from tests.test_engine_serving import MIXED, drain, submit
from zaya_jax.engine import Engine, SamplingParams
from zaya_jax.infer import quantize_model
from zaya_jax.infer.quantize import QuantizedArray

LENGTHS = [3, 12, 7]


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_engine_equals_quantized_generate_alone(mode):
    model = quantize_model(random_tiny_model(**MIXED), mode, 16)
    assert isinstance(model.layers.moe.gate.get_value(), QuantizedArray)  # the weights served are the quantized ones
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
        alone = zaya_jax.generate(model, [prompt], 6)[0].tolist()
        assert finished.tokens == alone[:len(finished.tokens)] and len(finished.tokens) >= 1
