"""Pallas kernels under an 8-device mesh (interpret mode) equal the XLA path on one device.

The kernels run per device inside jax.shard_map (batch over data/fsdp/expert, sequence over
context, heads over tensor); the reference is the XLA attention / ragged_dot path without a mesh.
Packed documents cross the context chunks' boundaries.
"""

import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding

from zaya_jax.config_files import load_config_file, model_config
from zaya_jax.model.attention_core import xla_attention
from zaya_jax.model.build import create_model
from zaya_jax.model.kernels import attention_fn
from zaya_jax.parallel.mesh import make_mesh, parse_mesh_flag
from zaya_jax.parallel.rules import batch_spec, state_shardings

CONFIG = load_config_file("configs/tiny.py")
CFG = model_config(CONFIG)
B, S = 8, 64


def primitives_inside_shard_map(jaxpr, inside=False, found=None):
    """{primitive name: set of 'inside shard_map' flags} over a closed jaxpr and its sub-jaxprs."""
    found = {} if found is None else found
    for eqn in jaxpr.eqns:
        found.setdefault(eqn.primitive.name, set()).add(inside)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            primitives_inside_shard_map(sub, inside or eqn.primitive.name == "shard_map", found)
    return found


def attention_inputs():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((B, S, CFG.num_q_heads, CFG.head_dim)).astype(np.float32)
    k, v = (rng.standard_normal((B, S, CFG.num_kv_heads, CFG.head_dim)).astype(np.float32) for _ in range(2))
    return q, k, v, packed_documents(rng)


def packed_documents(rng):
    """[B, S] segment ids of 4 documents per row, random lengths (boundaries anywhere, so
    documents run across the context chunks)."""
    starts = np.sort(rng.choice(np.arange(1, S), (B, 3)), axis=1)
    return (np.arange(S)[None, :, None] >= starts[:, None, :]).sum(-1).astype(np.int32)


def attention_loss(attention):
    def loss(q, k, v, seg):
        out = attention(q, k, v, seg)
        return jnp.sum(out * jnp.cos(out)), out
    return jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)


# (mesh, sliding window, packed documents): with context > 1 full causal attention runs zigzag,
# a window the contiguous chunks
ATTENTION_LAYOUTS = [("data=4,tensor=2", None, True), ("fsdp=2,expert=2,tensor=2", None, True),
                     ("data=2,context=2,tensor=2", None, True), ("data=2,context=4", None, True),
                     ("data=4,context=2", None, False), ("data=2,context=4", 5, True)]


@pytest.mark.parametrize("layout,window,documents", ATTENTION_LAYOUTS)
def test_pallas_attention_on_mesh_matches_xla(layout, window, documents):
    q, k, v, seg = attention_inputs()
    seg = seg if documents else None
    (_, ref_out), ref_grads = jax.jit(attention_loss(functools.partial(xla_attention, window=window)))(q, k, v, seg)
    mesh = make_mesh(parse_mesh_flag(layout))
    pallas = functools.partial(attention_fn(CFG.replace(attention_kernel="pallas")), window=window)
    with jax.set_mesh(mesh):
        heads = NamedSharding(mesh, jax.sharding.PartitionSpec(*batch_spec(mesh), "tensor"))
        args = (*(jax.device_put(x, heads) for x in (q, k, v)),
                seg if seg is None else jax.device_put(seg, NamedSharding(mesh, batch_spec(mesh))))
        fn = jax.jit(attention_loss(pallas))
        found = primitives_inside_shard_map(jax.make_jaxpr(fn)(*args).jaxpr)
        (_, out), grads = fn(*args)
    assert found["pallas_call"] == {True}, "every Pallas call runs inside shard_map"
    assert ("ppermute" in found) == ("context" in layout and window is None), "zigzag query halves"
    np.testing.assert_allclose(out, ref_out, atol=2e-5, rtol=2e-5)
    for g, r in zip(grads, ref_grads):
        np.testing.assert_allclose(g, r, atol=5e-5, rtol=5e-5)


def test_pallas_grouped_matmul_model_on_mesh_matches_xla():
    """The whole tiny model: Pallas grouped matmul (ragged backend) on data=2,expert=2,tensor=2
    against ragged_dot on one device; loss and every gradient."""
    ids = np.random.default_rng(1).integers(3, CFG.vocab_size, (B, S))
    reference_cfg = CFG.replace(moe_backend="ragged", moe_matmul_kernel="xla", expert_parallel="all_gather")
    model = create_model(reference_cfg)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss_fn(graphdef):
        def loss(params, rest, ids):
            return jnp.mean(nnx.merge(graphdef, params, rest)(ids) ** 2)
        return jax.value_and_grad(loss)

    ref_loss, ref_grads = jax.jit(loss_fn(graphdef))(params, rest, ids)
    pallas_graphdef, _, _ = nnx.split(create_model(reference_cfg.replace(moe_matmul_kernel="pallas")), nnx.Param, ...)
    mesh = make_mesh(parse_mesh_flag("data=2,expert=2,tensor=2"))
    with jax.set_mesh(mesh):
        sharded = (jax.device_put(params, state_shardings(params, mesh)), jax.device_put(rest, state_shardings(rest, mesh)),
                   jax.device_put(ids, NamedSharding(mesh, batch_spec(mesh))))
        fn = jax.jit(loss_fn(pallas_graphdef))
        found = primitives_inside_shard_map(jax.make_jaxpr(fn)(*sharded).jaxpr)
        loss, grads = fn(*sharded)
    assert found["pallas_call"] == {True}
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for (path, g), r in zip(jax.tree.leaves_with_path(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=1e-5, rtol=1e-4, err_msg=str(path))


# a sliding-window layer (contiguous chunks under context) before a full one (zigzag)
SLIDING = {"layer_types": ("hybrid_sliding", "hybrid"), "sliding_window": 12}


def model_logits_and_grads(attention_kernel, **overrides):
    """value_and_grad of the tiny model's weighted logits, with them as aux, for params, rest,
    ids [B,S], segment_ids [B,S]; and the parameters."""
    weights = np.random.default_rng(3).standard_normal((B, S, CFG.vocab_size)).astype(np.float32)
    cfg = CFG.replace(attention_kernel=attention_kernel, **overrides)
    graphdef, params, rest = nnx.split(create_model(cfg), nnx.Param, ...)

    def loss(params, rest, ids, seg):
        logits = nnx.merge(graphdef, params, rest)(ids, segment_ids=seg)
        return jnp.mean(logits * weights), logits
    return jax.value_and_grad(loss, has_aux=True), params, rest


@functools.cache
def model_batch_and_xla_result(sliding: bool):
    """ids and packed-document segment ids [B,S], and the XLA path's logits and gradients on one device."""
    rng = np.random.default_rng(2)
    ids, seg = rng.integers(3, CFG.vocab_size, (B, S)), packed_documents(rng)
    fn, params, rest = model_logits_and_grads("xla", **(SLIDING if sliding else {}))
    (_, logits), grads = jax.jit(fn)(params, rest, ids, seg)
    return ids, seg, logits, grads


@pytest.mark.parametrize("layout,sliding", [("data=8", False), ("data=4,context=2", False), ("data=2,context=4", False),
                                            ("data=4,context=2", True)])
def test_pallas_attention_model_with_context_parallelism_matches_xla(layout, sliding):
    """The whole tiny model with packed documents: Pallas attention on `layout` (context = 1, 2, 4;
    full layers, or a sliding-window and a full one) against the XLA attention path on one device;
    logits and every parameter's gradient."""
    ids, seg, ref_logits, ref_grads = model_batch_and_xla_result(sliding)
    fn, params, rest = model_logits_and_grads("pallas", **(SLIDING if sliding else {}))
    mesh = make_mesh(parse_mesh_flag(layout))
    with jax.set_mesh(mesh):
        rows = NamedSharding(mesh, batch_spec(mesh))
        sharded = (jax.device_put(params, state_shardings(params, mesh)), jax.device_put(rest, state_shardings(rest, mesh)),
                   jax.device_put(ids, rows), jax.device_put(seg, rows))
        fn = jax.jit(fn)
        found = primitives_inside_shard_map(jax.make_jaxpr(fn)(*sharded).jaxpr)
        (_, logits), grads = fn(*sharded)
    assert found["pallas_call"] == {True}
    assert ("all_gather" in found) == ("context" in layout)
    np.testing.assert_allclose(logits, ref_logits, atol=2e-5, rtol=1e-5)
    for (path, g), r in zip(jax.tree.leaves_with_path(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=1e-6, rtol=1e-4, err_msg=str(path))
