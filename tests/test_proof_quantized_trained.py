"""int8 / int4 weight quantization of a trained model, against the float32 model it came from.

The model is configs/tiny.py trained for 40 AdamW steps on two fixed synthetic batches until it
has learned them (the loss falls by more than 2 nats, asserted), so its logits are peaked as a
trained model's are, unlike a random init. Quality is measured on those batches, where the
model is confident: mean next-token KL(float || quantized) and top-1 agreement (the token
greedy decoding picks next, given the same prefix). Load-time quantization
(`zaya_jax.infer.load_hf(..., quantize=)`) must give exactly what quantizing in memory gives.
Bounds (group size 16): int8 KL < 1e-3 and >= 97% agreement; int4 KL < 0.1 and >= 80%.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zaya_jax
from zaya_jax.config_files import load_config_file, model_config
from zaya_jax.infer import load_hf, quantize_model
from zaya_jax.model.build import create_model
from zaya_jax.train import balancing
from zaya_jax.train.data import synthetic_batch
from zaya_jax.train.settings import BalancingSettings
from zaya_jax.checkpoints.model_parts import ModelParts
from zaya_jax.train.state import initial_state
from zaya_jax.train.step import train_step

STEPS, GROUP = 40, 16
CFG = model_config(load_config_file("configs/tiny.py"))


def _batch(index):
    return synthetic_batch(0, index, 8, 64, CFG.vocab_size, slice(None))


@pytest.fixture(scope="module")
def trained():
    """-> (float32 model, losses of the first and last step)."""
    model = create_model(CFG, seed=0)
    parts, tx = ModelParts(model), optax.adamw(optax.constant_schedule(1e-2))  # the step reads its count
    controller = balancing.make_controller(BalancingSettings(rate=1e-4))
    step = jax.jit(functools.partial(train_step, parts=parts, tx=tx, controller=controller,
                                     lr_schedule=lambda count: 1e-2, rope_theta=CFG.rope_theta, microbatches=1,
                                     loss_chunk=32, balance=True, include_skip=False, mesh=None))
    state = initial_state(*ModelParts.arrays(model), tx, controller, seed=0)
    losses = []
    for i in range(STEPS):
        state, metrics = step(state, _batch(i % 2))
        losses.append(float(metrics["loss"]))
    return parts.merge(state.params, state.biases), (losses[0], losses[-1])




def _forward(model, batch):
    return jax.jit(lambda m, b: m(b["inputs"], segment_ids=b["segment_ids"], positions=b["positions"]))(model, batch)


@pytest.mark.parametrize("mode,max_kl,min_agreement", [("int8", 1e-3, 0.97), ("int4", 0.1, 0.8)])
def test_quantized_trained_model_stays_close(trained, mode, max_kl, min_agreement):
    model, (first_loss, last_loss) = trained
    assert last_loss < first_loss - 2.0, (first_loss, last_loss)  # it did learn
    batch = _batch(1)
    ref = jax.nn.log_softmax(_forward(model, batch))
    quantized = quantize_model(model, mode, GROUP)
    logp = jax.nn.log_softmax(_forward(quantized, batch))
    mask = batch["segment_ids"] > 0
    kl = float(jnp.sum(jnp.where(mask, jnp.sum(jnp.exp(ref) * (ref - logp), -1), 0)) / mask.sum())
    agreement = float(jnp.sum((jnp.argmax(ref, -1) == jnp.argmax(logp, -1)) & mask) / mask.sum())
    assert 0 < kl < max_kl and agreement >= min_agreement, (kl, agreement)


def test_load_time_quantization_gives_the_in_memory_quantized_outputs(trained, tmp_path):
    model, _ = trained
    zaya_jax.save_hf(model, tmp_path / "ckpt")
    batch = _batch(1)
    for mode in ("int8", "int4"):
        loaded = load_hf(tmp_path / "ckpt", quantize=mode, group_size=GROUP)
        in_memory = quantize_model(model, mode, GROUP)
        np.testing.assert_allclose(_forward(loaded, batch), _forward(in_memory, batch), atol=1e-5, rtol=0)
        float_logits = _forward(model, batch)
        assert np.abs(np.asarray(_forward(loaded, batch) - float_logits)).max() > 0  # it is quantized
