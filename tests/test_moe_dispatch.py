"""Every dispatch backend computes the dense reference's function (values and gradients)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zaya_jax.config import ModelConfig
from zaya_jax.model import moe_dispatch
from zaya_jax.model.kernels import ragged_matmuls
from zaya_jax.model.moe_dispatch import ExpertWeights
from zaya_jax.native.grouped_matmul import grouped_matmul

T, D, I, E = 96, 16, 24, 4


def _problem(skewed: bool):
    keys = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(keys[0], (T, D))
    w = ExpertWeights(*(0.3 * jax.random.normal(k, s) for k, s in
                        zip(keys[1:4], [(E, D, I), (E, D, I), (E, I, D)])))
    if skewed:  # one hot expert, one empty expert, some skip-slot tokens
        expert = jnp.asarray(np.random.default_rng(0).choice([0, 0, 0, 1, 3, E], size=T), jnp.int32)
    else:
        expert = jax.random.randint(keys[4], (T,), 0, E + 1)
    return x, expert, w


BACKENDS = {
    "capacity": functools.partial(moe_dispatch.capacity, capacity_factor=float(E)),  # room for every token
    "ragged": moe_dispatch.ragged,
    "native": functools.partial(moe_dispatch.ragged, matmul=grouped_matmul),
    # the GPU default's kernels in interpret mode: gate and up in one grouped_matmuls call
    "pallas": functools.partial(moe_dispatch.ragged, **ragged_matmuls(ModelConfig(moe_matmul_kernel="pallas"))),
    "tiles8": functools.partial(moe_dispatch.tiles, tile=8),
    "tiles64": functools.partial(moe_dispatch.tiles, tile=64),
}


@pytest.mark.parametrize("skewed", [False, True])
@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_backend_equals_dense(name, skewed):
    x, expert, w = _problem(skewed)
    y_ref, _ = moe_dispatch.dense(x, expert, w)
    y, dropped = jax.jit(BACKENDS[name])(x, expert, w)
    assert int(dropped) == 0
    np.testing.assert_allclose(y, y_ref, atol=1e-5, rtol=1e-5)
    assert np.all(np.asarray(y)[np.asarray(expert) == E] == 0), "skip-slot tokens get no expert output"

    def loss(fn, x, w):
        return jnp.sum(jnp.sin(fn(x, expert, w)[0]))
    g_ref = jax.grad(functools.partial(loss, moe_dispatch.dense), argnums=(0, 1))(x, w)
    g = jax.jit(jax.grad(functools.partial(loss, BACKENDS[name]), argnums=(0, 1)))(x, w)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref)):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)  # fp32 summation order


def test_capacity_drops_and_counts_overflow():
    x, expert, w = _problem(skewed=True)
    cap = moe_dispatch.capacity_per_expert(T, E, 1.0)
    y, dropped = moe_dispatch.capacity(x, expert, w, capacity_factor=1.0)
    counts = np.bincount(np.asarray(expert), minlength=E + 1)[:E]
    assert int(dropped) == int(np.maximum(counts - cap, 0).sum()) > 0
    y_ref, _ = moe_dispatch.dense(x, expert, w)
    kept = np.flatnonzero(np.any(np.asarray(y) != 0, axis=1))
    np.testing.assert_allclose(np.asarray(y)[kept], np.asarray(y_ref)[kept], atol=1e-5)
    assert len(kept) == int((np.asarray(expert) < E).sum()) - int(dropped)


def test_tile_bound_is_enough_for_worst_case():
    # every expert gets one token more than a whole number of tiles
    tile = 8
    sizes = [tile + 1] * E
    expert = jnp.asarray(np.repeat(np.arange(E), sizes), jnp.int32)
    x = jax.random.normal(jax.random.key(1), (len(expert), D))
    _, _, w = _problem(False)
    np.testing.assert_allclose(moe_dispatch.tiles(x, expert, w, tile=tile)[0], moe_dispatch.dense(x, expert, w)[0],
                               atol=1e-5)


def test_expert_runs_locate_each_experts_rows():
    from zaya_jax.model.expert_windows import expert_runs
    runs = expert_runs(jnp.asarray([0, 9, 8, 1]))
    np.testing.assert_array_equal(runs.start, [0, 0, 9, 17])
    np.testing.assert_array_equal(runs.size, [0, 9, 8, 1])
