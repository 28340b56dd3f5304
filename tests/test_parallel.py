"""Sharded == unsharded: loss and gradients of configs/tiny.py on every 8-device layout."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding

from tests.ragged_emulation import ragged_all_to_all_by_all_gather
from zaya_jax.config_files import load_config_file, model_config
from zaya_jax.model import moe
from zaya_jax.model.build import create_model
from zaya_jax.parallel.mesh import make_mesh, parse_mesh_flag, resolve_mesh_shape
from zaya_jax.parallel.moe_sharding import dispatch_on_mesh
from zaya_jax.parallel.rules import batch_spec, state_shardings

CONFIG = load_config_file("configs/tiny.py")
# Dropless everywhere (all_to_all expert parallelism uses fixed capacity), so every layout computes one function.
CFG = model_config(CONFIG).replace(capacity_factor=float(CONFIG.model.num_experts))
B, S = CONFIG.train.global_batch_size, CONFIG.train.seq_len
RNG = np.random.default_rng(0)
IDS = RNG.integers(3, CFG.vocab_size, (B, S))
SEG = np.where(np.arange(S) < RNG.integers(8, S - 8, (B, 1)), 1, 2)


def loss_fn(graphdef, rest):
    def loss(params, ids, seg):
        logits = nnx.merge(graphdef, params, rest)(ids, segment_ids=seg)[:, :-1]
        nll = jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, ids[:, 1:, None], -1)[..., 0]
        mask = (seg[:, 1:] == seg[:, :-1]).astype(jnp.float32)
        return jnp.sum(nll * mask) / jnp.sum(mask)
    return loss


@pytest.fixture(scope="module")
def reference():
    model = create_model(CFG)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    loss, grads = jax.jit(jax.value_and_grad(loss_fn(graphdef, rest)))(params, IDS, SEG)
    return model, loss, grads


@pytest.mark.parametrize("layout", ["data=8", "fsdp=8", "data=2,fsdp=2,expert=2", "data=2,tensor=2,expert=2",
                                    "data=4,context=2", "expert=4,tensor=2", "all_gather:data=2,expert=4",
                                    "ragged_all_to_all:data=2,expert=4"])
def test_layout_matches_single_device(reference, layout, monkeypatch):
    model, ref_loss, ref_grads = reference
    if ":" in layout:  # dropless expert parallelism: same init, no capacity to rely on
        mode, layout = layout.split(":")
        model = create_model(CFG.replace(expert_parallel=mode, capacity_factor=1.0))
        # XLA:CPU cannot run ragged_all_to_all: the model's MoE blocks get the emulation
        monkeypatch.setattr(moe, "dispatch_on_mesh",
                            functools.partial(dispatch_on_mesh, exchange=ragged_all_to_all_by_all_gather))
    mesh = make_mesh(parse_mesh_flag(layout))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    with jax.set_mesh(mesh):
        params = jax.device_put(params, state_shardings(params, mesh))
        rest = jax.device_put(rest, state_shardings(rest, mesh))
        batch = NamedSharding(mesh, batch_spec(mesh))
        ids, seg = jax.device_put(IDS, batch), jax.device_put(SEG, batch)
        loss, grads = jax.jit(jax.value_and_grad(loss_fn(graphdef, rest)))(params, ids, seg)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for (path, g), r in zip(jax.tree.leaves_with_path(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=1e-5, rtol=1e-4, err_msg=str(path))


def test_parameters_are_actually_sharded():
    model = create_model(CFG)
    mesh = make_mesh({"data": 2, "tensor": 2, "expert": 2})
    specs = state_shardings(nnx.state(model, nnx.Param), mesh)
    assert specs["layers"]["moe"]["gate"].get_value().spec == jax.P(None, "expert", None, "tensor")
    assert specs["layers"]["attention"]["k_proj"].get_value().spec == jax.P(None, None, "tensor", None)


@pytest.mark.parametrize("sizes,message", [
    ({"data": 3}, "product of mesh axes (data=3) = 3 != 8 devices"),
    ({"data": -1, "fsdp": -1}, "only one axis may be -1"),
    ({"data": -1, "fsdp": 3}, "cannot fill 8 devices"),
    ({"pipeline": 2}, "mesh.pipeline: unknown mesh axis"),
])
def test_bad_mesh_is_named(sizes, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        resolve_mesh_shape(sizes, 8)


def test_indivisible_dimension_names_dimension_and_axis():
    model = create_model(CFG)
    mesh = make_mesh({"tensor": 4, "data": 2})  # tiny has 4 + 2 packed CCA heads
    with pytest.raises(ValueError, match=r"layers/attention/conv_depthwise_bias: dimension 1 \(qk_heads, size 6\) "
                                         r"is not divisible by mesh axis tensor of size 4"):
        state_shardings(nnx.state(model, nnx.Param), mesh)
