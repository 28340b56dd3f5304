"""Which parameters Muon takes, per-matrix Newton-Schulz on stacked parameters, schedules."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.model_fixtures import TINY
from zaya_jax.model.build import abstract_model
from zaya_jax.train.optimizer import MUON_MATRICES, decay_mask, make_optimizer, param_labels, path_name, schedule
from zaya_jax.train.settings import OptimizerSettings

MUON = OptimizerSettings(name="muon", learning_rate=1e-2, warmup_steps=0, schedule="constant", grad_clip_norm=0.0,
                         weight_decay=0.0)


def _named(tree) -> dict:
    return {path_name(p): leaf for p, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def test_muon_takes_exactly_the_matrices():
    params = nnx.to_pure_dict(nnx.state(abstract_model(TINY), nnx.Param))
    labels = _named(param_labels(params, MUON))
    assert {name for name, label in labels.items() if label == "muon"} == set(MUON_MATRICES)
    assert {"embed", "layers/attention/conv_grouped_weight", "layers/moe/router/fc1_bias", "layers/input_norm/weight",
            "layers/attention/key_temperature", "layers/moe_residual/residual_scale"} <= {
        name for name, label in labels.items() if label == "adamw"}
    assert set(_named(param_labels(params, OptimizerSettings(name="adamw"))).values()) == {"adamw"}
    decayed = _named(decay_mask(params, MUON))
    assert decayed["embed"] and decayed["layers/moe/gate"] and decayed["layers/attention/conv_depthwise_weight"]
    assert not any(decayed[n] for n in decayed if n.endswith(("bias", "norm/weight", "scale", "temperature")))
    assert not _named(decay_mask(params, OptimizerSettings(decay_embedding=False)))["embed"]


def test_newton_schulz_runs_per_matrix_of_a_stack():
    """[L, E, D, I] experts: each [D, I] matrix is orthogonalised on its own."""
    grads = jax.random.normal(jax.random.key(0), (2, 3, 16, 24))
    tx = make_optimizer(MUON, total_steps=10)

    def update(g):
        tree = {"layers": {"moe": {"gate": g}}}
        return tx.update(tree, tx.init(tree), tree)[0]["layers"]["moe"]["gate"]

    stacked = update(grads)
    for layer in range(2):
        for expert in range(3):
            alone = update(grads[layer:layer + 1, expert:expert + 1])[0, 0]
            np.testing.assert_allclose(stacked[layer, expert], alone, atol=1e-6)
            # Moonlight RMS matching: NS gives singular values ~1 (RMS 1/sqrt(max dim)); x 0.2 sqrt(max dim)
            rms = float(jnp.sqrt(jnp.mean(stacked[layer, expert] ** 2))) / MUON.learning_rate
            assert 0.1 < rms < 0.25


def test_attention_projection_matrix_is_input_by_heads():
    """o_proj [L, N, H, D] is updated as the (N*H) x D matrix (like a plain [L, R, R] matrix)."""
    grads = jax.random.normal(jax.random.key(1), (1, 4, 8, 32))
    tx = make_optimizer(MUON, total_steps=10)
    heads = {"layers": {"attention": {"o_proj": grads}}}
    plain = {"layers": {"moe": {"router": {"fc1": grads.reshape(1, 32, 32)}}}}
    u_heads = tx.update(heads, tx.init(heads), heads)[0]["layers"]["attention"]["o_proj"]
    u_plain = tx.update(plain, tx.init(plain), plain)[0]["layers"]["moe"]["router"]["fc1"]
    np.testing.assert_allclose(u_heads.reshape(1, 32, 32), u_plain, atol=1e-6)


@pytest.mark.parametrize("kind", ["cosine", "wsd", "constant"])
def test_schedules(kind):
    s = OptimizerSettings(schedule=kind, warmup_steps=10, decay_fraction=0.2, min_lr_ratio=0.1)
    lr = schedule(s, total_steps=100, peak=1.0)
    assert float(lr(0)) == 0.0 and float(lr(5)) == pytest.approx(0.5) and float(lr(10)) == pytest.approx(1.0)
    if kind == "wsd":
        assert float(lr(79)) == pytest.approx(1.0) and float(lr(90)) == pytest.approx(0.55)
    if kind == "constant":
        assert float(lr(100)) == pytest.approx(1.0)
    else:
        assert float(lr(100)) == pytest.approx(0.1)


def _newton_schulz_batches(compiled_text: str, rows: int) -> set[int]:
    """The batch sizes of the compiled [batch, rows, rows] matmuls (Newton-Schulz's x @ x^T)."""
    found = re.findall(rf"= f32\[(\d+),{rows},{rows}\]\{{[\d,]+\}} dot\(", compiled_text)
    return {int(b) for b in found}


@pytest.mark.parametrize("layers", [8, 6])  # 6 layers: an uneven share over 8 ranks
def test_newton_schulz_is_spread_over_the_data_ranks_and_the_update_is_optax_muons(layers):
    """On an 8-way data mesh each rank orthogonalises its share of the stacked matrices; two steps of
    updates and the momentum equal optax's scale_by_muon on the parameters' own dimension numbers, on
    one device."""
    from jax.sharding import AxisType, NamedSharding, PartitionSpec
    from optax.contrib import scale_by_muon

    from zaya_jax.train.optimizer import distributed_muon
    keys = jax.random.split(jax.random.key(2), 4)
    grads = [{"layers": {"moe": {"gate": jax.random.normal(keys[i], (layers, 3, 16, 24))},
                         "attention": {"o_proj": jax.random.normal(keys[i + 2], (layers, 4, 8, 32))}}}
             for i in range(2)]
    reference = scale_by_muon(ns_steps=MUON.muon_ns_steps, beta=MUON.muon_momentum, eps=MUON.eps,
                              nesterov=MUON.muon_nesterov, weight_dimension_numbers=lambda u: jax.tree_util.
                              tree_map_with_path(lambda p, _: MUON_MATRICES[path_name(p)], u))
    ours = distributed_muon(dataclasses.replace(MUON, muon_distributed=True))

    def two_steps(tx, g0, g1):
        state = tx.init(g0)
        first, state = tx.update(g0, state)
        second, state = tx.update(g1, state)
        return first, second, state.mu

    expected = jax.jit(lambda a, b: two_steps(reference, a, b))(*grads)
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    replicated = jax.device_put(grads, NamedSharding(mesh, PartitionSpec()))
    with jax.set_mesh(mesh):
        spread = jax.jit(lambda a, b: two_steps(ours, a, b))
        got = spread(*replicated)
        text = spread.lower(*replicated).compile().as_text()
    # Five Newton-Schulz iterations amplify float32 rounding: built at LLVM -O0 (the suite's
    # fake_devices.CHEAP_COMPILE) one of 9,216 entries differed by 1.5e-6 (3.6e-6 relative); a wrong
    # layout, dimension or update is off by O(0.1).
    for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(got), strict=True):
        assert a.shape == b.shape
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5, rtol=1e-5)
    share = -(-layers * 3 // 8)  # the gate's layers x experts matrices, ceil-divided over 8 ranks
    assert _newton_schulz_batches(text, 16) == {share}, _newton_schulz_batches(text, 16)
    alone = jax.jit(lambda a, b: two_steps(ours, a, b)).lower(*grads).compile().as_text()  # no mesh: all of it
    assert _newton_schulz_batches(alone, 16) == {layers * 3}
    with jax.set_mesh(mesh):  # the option off (the default): every rank orthogonalises every matrix
        off = jax.jit(lambda a, b: two_steps(distributed_muon(MUON), a, b)).lower(*replicated).compile().as_text()
    assert _newton_schulz_batches(off, 16) == {layers * 3}
