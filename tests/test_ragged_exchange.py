"""The ragged_all_to_all expert-parallel exchange on XLA:CPU, with the collective emulated.

The emulation is checked against jax's documented example; the exchange's offsets and sizes
against a numpy reading of the routing; one MoE layer against the local dispatch (values and
gradients, skewed routing included); and the layout is refused on CPU before compiling.
(The whole model on an 8-device mesh: tests/test_parallel.py.)
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from tests.ragged_emulation import ragged_all_to_all_by_all_gather
from zaya_jax.config_files import load_config_file, model_config
from zaya_jax.model import moe_dispatch
from zaya_jax.model.moe_dispatch import ExpertWeights
from zaya_jax.parallel.mesh import check_platform_support, make_mesh, parse_mesh_flag
from zaya_jax.parallel.moe_sharding import dispatch_on_mesh
from zaya_jax.parallel.ragged_exchange import exchange_plan
from zaya_jax.planner.step_plan import StepShape, plan
from zaya_jax.train.loop import Trainer


def per_device(mesh: Mesh, fn, *stacked):
    """Runs fn on each device's row of every stacked [P, ...] input; returns outputs stacked [P, ...]."""
    axis = mesh.axis_names[0]
    body = lambda *rows: jax.tree.map(lambda y: y[None], fn(*(r[0] for r in rows)))  # noqa: E731
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(axis), out_specs=P(axis)))(*stacked)


def test_emulation_follows_the_documented_example():
    """The example of jax.lax.ragged_all_to_all's docstring (axis of size 2)."""
    mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
    args = [np.array(a) for a in ([[1, 2, 2], [3, 4, 0]], [[0, 0, 0, 0], [0, 0, 0, 0]], [[0, 1], [0, 1]],
                                  [[1, 2], [1, 1]], [[0, 0], [1, 2]], [[1, 1], [2, 1]])]
    result = per_device(mesh, functools.partial(ragged_all_to_all_by_all_gather, axis_name="x"), *args)
    np.testing.assert_array_equal(result, [[1, 3, 0, 0], [2, 2, 4, 0]])


def test_exchange_plan_matches_the_routing():
    ep, local, t = 4, 2, 16
    e = ep * local
    expert = np.random.default_rng(0).integers(0, e + 1, (ep, t))  # index e: the skip slot
    expert[1] = 0                                                    # skew: all of device 1's tokens to expert 0
    mesh = Mesh(np.array(jax.devices()[:ep]), ("expert",))
    plan_fn = lambda ex: exchange_plan(moe_dispatch.sort_by_expert(ex, e).group_sizes[:e], axis="expert",  # noqa
                                       local_experts=local, buffer_rows=ep * t)
    got = jax.tree.map(np.asarray, per_device(mesh, plan_fn, expert))

    counts = np.stack([np.bincount(row, minlength=e + 1)[:e].reshape(ep, local) for row in expert])  # [src,dst,l]
    sizes = counts.sum(2)                                            # [src, dst]
    starts = np.cumsum(sizes, 1) - sizes                             # run starts in each source's sorted buffer
    landing = (np.cumsum(sizes, 0) - sizes).T                        # [dst, src] run starts on each receiver
    np.testing.assert_array_equal(got.send_sizes, sizes)
    np.testing.assert_array_equal(got.input_offsets, starts)
    np.testing.assert_array_equal(got.recv_sizes, sizes.T)          # ragged_all_to_all's contract
    np.testing.assert_array_equal(got.recv_offsets, landing)
    np.testing.assert_array_equal(got.output_offsets, landing.T)
    np.testing.assert_array_equal(got.return_offsets, starts.T)
    for dst in range(ep):
        rows = np.concatenate([np.repeat(np.arange(local), counts[src, dst]) for src in range(ep)])
        np.testing.assert_array_equal(got.row_expert[dst], np.pad(rows, (0, ep * t - rows.size),
                                                                  constant_values=local))


@pytest.mark.parametrize("layout", ["expert=8", "data=2,expert=2,tensor=2"])
@pytest.mark.parametrize("routing", ["random", "all_to_expert_0"])
def test_one_moe_layer_matches_local_dispatch(layout, routing):
    b, s, d, i, e = 8, 8, 16, 8, 8
    keys = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(keys[0], (b, s, d))
    w = ExpertWeights(*(0.3 * jax.random.normal(k, shape) for k, shape in
                        zip(keys[1:4], [(e, d, i), (e, d, i), (e, i, d)])))
    expert = (jax.random.randint(keys[4], (b, s), 0, e + 1) if routing == "random"
              else jnp.zeros((b, s), jnp.int32).at[:, -1].set(e))  # one skip-slot token per row

    def loss(x, w, **mesh_options):
        y, dropped = dispatch_on_mesh(moe_dispatch.dense, x, expert, w, capacity_factor=1.0, **mesh_options)
        return jnp.sum(jnp.sin(y)), (y, dropped)

    (_, (ref_y, _)), ref_grads = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))(x, w)
    with jax.set_mesh(make_mesh(parse_mesh_flag(layout))):
        (_, (y, dropped)), grads = jax.jit(jax.value_and_grad(
            functools.partial(loss, expert_parallel="ragged_all_to_all", exchange=ragged_all_to_all_by_all_gather),
            (0, 1), has_aux=True))(x, w)
    assert int(dropped) == 0
    np.testing.assert_allclose(y, ref_y, atol=1e-5, rtol=1e-5)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(g, r, atol=1e-5, rtol=1e-5)


RAGGED_ON_CPU = (r"model.expert_parallel='ragged_all_to_all' with mesh.expert=4 needs jax.lax.ragged_all_to_all, "
                 r"which platform 'cpu' cannot run .*use model.expert_parallel=all_to_all .* or "
                 r"model.expert_parallel=all_gather")


def test_platform_check_names_field_value_platform_and_alternatives():
    with pytest.raises(ValueError, match=RAGGED_ON_CPU):
        check_platform_support({"expert": 4}, "ragged_all_to_all")     # this process: cpu
    check_platform_support({"expert": 4}, "ragged_all_to_all", "gpu")
    check_platform_support({"expert": 1, "data": 8}, "ragged_all_to_all")  # no exchange without an expert axis
    check_platform_support({"expert": 4}, "all_to_all")


def test_ragged_layer_on_cpu_fails_while_tracing():
    x, w = jnp.zeros((8, 4, 8)), ExpertWeights(jnp.zeros((4, 8, 4)), jnp.zeros((4, 8, 4)), jnp.zeros((4, 4, 8)))
    f = functools.partial(dispatch_on_mesh, moe_dispatch.dense, capacity_factor=1.0,
                          expert_parallel="ragged_all_to_all")
    with jax.set_mesh(make_mesh({"data": 2, "expert": 4})), pytest.raises(ValueError, match=RAGGED_ON_CPU):
        jax.jit(f).trace(x, jnp.zeros((8, 4), jnp.int32), w)


def test_trainer_refuses_ragged_on_cpu_before_initialising(tmp_path, monkeypatch):
    monkeypatch.setattr(Trainer, "_initial_state", lambda self: pytest.fail("reached model initialisation"))
    config = load_config_file("configs/tiny.py")
    config.model.expert_parallel, config.mesh.expert = "ragged_all_to_all", 4
    with pytest.raises(ValueError, match=RAGGED_ON_CPU):
        Trainer(config, str(tmp_path))


def test_planner_counts_ragged_traffic_without_capacity_padding():
    cfg = model_config(load_config_file("configs/tiny.py")).replace(capacity_factor=1.25)
    mesh, shape = {"data": 2, "expert": 4}, StepShape(8, 64, platform="gpu")
    traffic = {mode: plan(cfg.replace(expert_parallel=mode), mesh, shape)["collective_bytes_per_step_per_device"]
               for mode in ("all_to_all", "ragged_all_to_all")}
    assert traffic["ragged_all_to_all"]["all_to_all"] * 1.25 == pytest.approx(traffic["all_to_all"]["all_to_all"])
    assert traffic["ragged_all_to_all"]["all_gather"] == traffic["all_to_all"]["all_gather"]
    with pytest.raises(ValueError, match=RAGGED_ON_CPU):
        plan(cfg.replace(expert_parallel="ragged_all_to_all"), mesh, StepShape(8, 64, platform="cpu"))
