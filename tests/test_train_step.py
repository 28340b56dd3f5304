"""The train step's maths: loss, gradient accumulation, the balancing controller, non-finite skips."""

import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from tests.model_fixtures import TINY, tiny_model
from zaya_jax.train import balancing
from zaya_jax.train.data import synthetic_batch
from zaya_jax.train.loss import chunked_nll_sum, token_nll, weighted_nll_sum
from zaya_jax.train.settings import BalancingSettings
from zaya_jax.checkpoints.model_parts import ModelParts
from zaya_jax.train.state import initial_state
from zaya_jax.train.step import train_step

B, S = 4, 32
BATCH = synthetic_batch(0, 0, B, S, TINY.vocab_size, slice(None))
CONTROLLER = balancing.make_controller(BalancingSettings(rate=1e-2))
SGD = optax.sgd(1.0)  # params move by exactly -grad: gradients are compared through the params


@functools.lru_cache(maxsize=None)
def _parts():
    return ModelParts(tiny_model())


def _state(tx=SGD):
    params, biases = ModelParts.arrays(tiny_model())
    return initial_state(params, biases, tx, CONTROLLER, seed=0)


@functools.lru_cache(maxsize=None)
def _step(tx=SGD, microbatches=1, balance=True):
    return jax.jit(functools.partial(
        train_step, parts=_parts(), tx=tx, controller=CONTROLLER, lr_schedule=lambda count: 0.0,
        rope_theta=10_000.0, microbatches=microbatches, loss_chunk=8, balance=balance, include_skip=False,
        mesh=None))


def _full_nll_sum(logits_fn, hidden):
    return jnp.sum(token_nll(logits_fn(hidden), BATCH["targets"]) * BATCH["loss_mask"])


def test_chunked_loss_equals_full_logits():
    model = tiny_model()
    hidden = jax.random.normal(jax.random.key(0), (B, S, TINY.hidden_size))
    for chunk in (8, 12, 32):  # 12 does not divide 32: falls back to 8
        loss = jax.jit(lambda h, c=chunk: chunked_nll_sum(model.logits, h, BATCH["targets"], BATCH["loss_mask"], c))
        np.testing.assert_allclose(loss(hidden), jax.jit(_full_nll_sum, static_argnums=0)(model.logits, hidden),
                                   rtol=1e-6)
    # gradients reach both the hidden states and the (closed-over) tied embedding
    logits_fn = lambda embed: lambda h: jnp.einsum("...d,vd->...v", h, embed)  # noqa: E731
    grad = jax.jit(jax.grad(lambda h, e: chunked_nll_sum(logits_fn(e), h, BATCH["targets"], BATCH["loss_mask"], 8),
                            argnums=(0, 1)))
    ref = jax.jit(jax.grad(lambda h, e: _full_nll_sum(logits_fn(e), h), argnums=(0, 1)))
    for g, r in zip(grad(hidden, model.embed[...]), ref(hidden, model.embed[...])):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)


def _vocab_matmuls(fn, *args) -> int:
    """dot_generals with a vocabulary-sized operand in the jaxpr of fn's value and gradient."""
    jaxpr = jax.make_jaxpr(jax.value_and_grad(fn, argnums=(0, 1)))(*args)

    def count(jaxpr):
        n = 0
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                n += any(TINY.vocab_size in v.aval.shape for v in eqn.invars)
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                n += count(sub)
        return n
    return count(jaxpr.jaxpr)


def test_fused_loss_head_equals_full_logits_and_runs_three_matmuls():
    """weighted_nll_sum's value and gradients (hidden, tied embedding, token weights) equal autodiff
    of the full-logits loss; its gradient is computed with the forward: 3 vocabulary matmuls per
    chunk (logits, d hidden, d embed), against 4 for the checkpointed chunks (the logits again)."""
    model = tiny_model()
    hidden = jax.random.normal(jax.random.key(0), (B, S, TINY.hidden_size))
    logits_fn = lambda h, e: jnp.einsum("...d,vd->...v", h, e)  # noqa: E731
    weights = BATCH["loss_mask"] * jnp.linspace(0.5, 1.5, S)  # any weights, not only 0/1
    ref = jax.jit(jax.value_and_grad(
        lambda h, e, w: jnp.sum(token_nll(logits_fn(h, e), BATCH["targets"]) * w), argnums=(0, 1, 2)))
    expected = ref(hidden, model.embed[...], weights)
    for chunk in (8, 32):  # 4 chunks in a scan; one chunk, no loop
        fused = jax.jit(jax.value_and_grad(
            lambda h, e, w, c=chunk: weighted_nll_sum(logits_fn, h, e, BATCH["targets"], w, c), argnums=(0, 1, 2)))
        got = fused(hidden, model.embed[...], weights)
        for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
            np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)
    mask = BATCH["loss_mask"]
    assert _vocab_matmuls(lambda h, e: weighted_nll_sum(logits_fn, h, e, BATCH["targets"], mask, 8),
                          hidden, model.embed[...]) == 3
    assert _vocab_matmuls(lambda h, e: chunked_nll_sum(lambda x: logits_fn(x, e), h, BATCH["targets"], mask, 8),
                          hidden, model.embed[...]) == 4


def test_fused_loss_head_scales_its_gradients_by_the_incoming_cotangent():
    """A caller that scales the loss or uses it inside a larger expression (a loss weight, an
    auxiliary objective) gets the chain rule: 3.7 * L + 0.5 * L**2 differentiated through the fused
    head equals the same expression of the full-logits loss, for hidden, the weight and the token
    weights (cotangents 3.7 and 3.7 + L, not 1)."""
    model = tiny_model()
    hidden = jax.random.normal(jax.random.key(1), (B, S, TINY.hidden_size))
    logits_fn = lambda h, e: jnp.einsum("...d,vd->...v", h, e)  # noqa: E731
    weights = BATCH["loss_mask"] * jnp.linspace(0.5, 1.5, S)
    outer = {"scaled": lambda loss: 3.7 * loss, "inside an expression": lambda loss: 3.7 * loss + 0.5 * loss ** 2}
    for name, f in outer.items():
        ref = jax.jit(jax.grad(lambda h, e, w: f(jnp.sum(token_nll(logits_fn(h, e), BATCH["targets"]) * w) / S),
                               argnums=(0, 1, 2)))
        fused = jax.jit(jax.grad(lambda h, e, w: f(weighted_nll_sum(logits_fn, h, e, BATCH["targets"], w, 8) / S),
                                 argnums=(0, 1, 2)))
        for g, r in zip(fused(hidden, model.embed[...], weights), ref(hidden, model.embed[...], weights)):
            np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5, err_msg=name)


def test_step_gradient_is_the_full_logits_gradient():
    """The LM step (its loss head fused) moves every parameter by the gradient of the token-mean
    nll of the model's full logits (SGD at rate 1, no balancing)."""
    state = _state()
    new, _ = _step(balance=False)(state, BATCH)
    graphdef, params, rest = nnx.split(tiny_model(), nnx.Param, ...)

    def loss(p):
        logits = nnx.merge(graphdef, p, rest)(BATCH["inputs"], segment_ids=BATCH["segment_ids"],
                                               positions=BATCH["positions"])
        return jnp.sum(token_nll(logits, BATCH["targets"]) * BATCH["loss_mask"]) / jnp.sum(BATCH["loss_mask"])
    grads = nnx.to_pure_dict(jax.jit(jax.grad(loss))(params))
    moved = jax.tree.map(lambda a, b: a - b, state.params, new.params)
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
        np.testing.assert_allclose(_at(moved, path), g, rtol=2e-4, atol=1e-6, err_msg=jax.tree_util.keystr(path))


def _at(tree, path):
    for key in path:
        tree = tree[key.key]
    return tree


def test_step_loss_is_the_token_mean_nll():
    _, metrics = _step()(_state(), BATCH)
    model = tiny_model()
    logits = jax.jit(lambda b: model(b["inputs"], segment_ids=b["segment_ids"], positions=b["positions"]))(BATCH)
    nll = token_nll(logits, BATCH["targets"])
    expected = np.sum(nll * BATCH["loss_mask"]) / np.sum(BATCH["loss_mask"])
    np.testing.assert_allclose(metrics["loss"], expected, rtol=1e-5)
    assert int(metrics["tokens"]) == int(BATCH["loss_mask"].sum())
    assert metrics["expert_counts"].shape == (TINY.num_layers, TINY.num_experts + 1)
    assert int(metrics["expert_counts"].sum()) == TINY.num_layers * int((BATCH["segment_ids"] > 0).sum())


def test_two_microbatches_equal_one_big_batch():
    state = _state()
    one, m1 = _step(microbatches=1)(state, BATCH)
    two, m2 = _step(microbatches=2)(state, BATCH)
    np.testing.assert_allclose(m2["loss"], m1["loss"], rtol=1e-6)
    np.testing.assert_allclose(m2["grad_norm"], m1["grad_norm"], rtol=1e-5)
    np.testing.assert_array_equal(m2["expert_counts"], m1["expert_counts"])
    for a, b in zip(jax.tree.leaves(two.params), jax.tree.leaves(one.params)):
        np.testing.assert_allclose(a, b, atol=1e-6)
    np.testing.assert_allclose(two.biases, one.biases, atol=1e-7)


def test_controller_pushes_overused_experts_down():
    biases = jnp.zeros((2, 5)).at[:, -1].set(-1.0)
    counts = jnp.asarray([[70, 10, 10, 10, 40], [0, 0, 50, 50, 0]])  # layer 0: expert 0 over-used
    error = balancing.load_error(counts, include_skip=False)
    np.testing.assert_allclose(error[0], [0.45, -0.15, -0.15, -0.15, 0.0])
    new, _ = balancing.update_biases(biases, CONTROLLER.init(biases), counts, CONTROLLER, include_skip=False)
    assert new[0, 0] < 0 < new[0, 1] and new[1, 0] > 0 > new[1, 2]
    assert np.all(np.asarray(new[:, -1]) == -1.0)  # the skip slot is not balanced
    with_skip, _ = balancing.update_biases(biases, CONTROLLER.init(biases), counts, CONTROLLER, include_skip=True)
    assert with_skip[0, -1] < -1.0  # skip over-used in layer 0 (40 of 140 > 1/5)


def test_controller_moves_only_biases_in_the_step():
    state = _state()
    new, metrics = _step()(state, BATCH)
    frozen, _ = _step(balance=False)(state, BATCH)
    # equal but for the summation order of two differently fused programs (2e-15 apart with jax 0.10's
    # legacy XLA:CPU emitters, tests/fake_devices.py); a controller reaching the weights moves them by
    # a learning rate's step (1e-3)
    for a, b in zip(jax.tree.leaves(new.params), jax.tree.leaves(frozen.params)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-12)
    counts = np.asarray(metrics["expert_counts"])[:, :-1]
    moved = np.asarray(new.biases - state.biases)[:, :-1]
    for layer in range(counts.shape[0]):
        load = counts[layer] / counts[layer].sum()
        assert np.all(moved[layer][load > 1 / len(load)] < 0) and np.all(moved[layer][load < 1 / len(load)] > 0)
    np.testing.assert_array_equal(new.biases[:, -1], state.biases[:, -1])
    np.testing.assert_array_equal(frozen.biases, state.biases)


@pytest.mark.parametrize("poison", ["params", "inputs"])
def test_nonfinite_step_is_skipped_and_counted(poison):
    state = _state()
    if poison == "params":
        state = state.replace(params={**state.params, "final_norm": {"weight": state.params["final_norm"]["weight"]
                                                                     .at[0].set(jnp.nan)}})
    else:  # an embedding row of inf reaches the loss through the forward pass
        state = state.replace(params={**state.params, "embed": state.params["embed"].at[BATCH["inputs"][0, 0]]
                                      .set(jnp.inf)})
    new, metrics = _step()(state, BATCH)
    assert not np.isfinite(metrics["loss"]) or not np.isfinite(metrics["grad_norm"])
    assert int(metrics["skipped"]) == 1 and int(new.skipped_steps) == 1 and int(new.nonfinite_streak) == 1
    assert int(new.step) == 1
    for a, b in zip(jax.tree.leaves((new.params, new.opt_state, new.biases, new.controller_state)),
                    jax.tree.leaves((state.params, state.opt_state, state.biases, state.controller_state))):
        np.testing.assert_array_equal(a, b)
    again, _ = _step()(new, BATCH)
    assert int(again.nonfinite_streak) == 2 and int(again.skipped_steps) == 2
