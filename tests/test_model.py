"""Model-level properties: backends agree end to end, causality, documents, layouts, stats."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.model_fixtures import tiny_model

IDS = np.random.default_rng(0).integers(3, 64, (2, 24))


def _logits(model, ids, **kw):
    return np.asarray(jax.jit(lambda m, x: m(x, **kw))(model, ids))


@pytest.mark.parametrize("backend", ["capacity", "ragged", "tiles", "native"])
def test_model_backends_match_dense_values_and_grads(backend):
    dense = tiny_model(moe_backend="dense")
    other = tiny_model(moe_backend=backend, capacity_factor=4.0, moe_tile_size=8)

    def loss_and_grad(model):
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def loss(p):
            logits, stats = nnx.merge(graphdef, p, rest).forward_with_stats(IDS)
            return jnp.mean(jax.nn.logsumexp(logits, -1) - logits[..., 0]), stats.dropped
        return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)

    (l_ref, _), g_ref = loss_and_grad(dense)
    (l, dropped), g = loss_and_grad(other)
    assert int(np.sum(dropped)) == 0
    np.testing.assert_allclose(l, l_ref, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref)):
        np.testing.assert_allclose(a, b, atol=2e-6, rtol=1e-4)


def test_scan_and_python_loop_agree():
    np.testing.assert_allclose(_logits(tiny_model(scan_layers=False), IDS), _logits(tiny_model(), IDS),
                               atol=1e-6)


@pytest.mark.parametrize("remat", ["full", "dots_no_batch_and_kernels"])  # the CPU default: native experts
def test_remat_does_not_change_gradients(remat):
    def grads(model):
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        return jax.jit(jax.grad(lambda p: jnp.sum(nnx.merge(graphdef, p, rest)(IDS)[..., :5])))(params)
    for a, b in zip(jax.tree.leaves(grads(tiny_model(remat=remat))), jax.tree.leaves(grads(tiny_model()))):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)  # recomputation reorders fp32 sums


def test_kernel_saving_remat_does_not_run_the_expert_matmuls_again():
    """In the lowered value-and-gradient of the tiny model (native CPU experts: an FFI call per
    matmul), `dots_no_batch` runs the three forward expert matmuls again in the backward pass;
    `dots_no_batch_and_kernels` saves their outputs, as no remat does."""
    def forward_calls(remat):
        graphdef, params, rest = nnx.split(tiny_model(remat=remat), nnx.Param, ...)
        loss = lambda p: jnp.sum(nnx.merge(graphdef, p, rest)(IDS)[..., :5])
        return len(re.findall(r'zaya_grouped_matmul\b(?!_)', jax.jit(jax.value_and_grad(loss)).lower(params).as_text()))
    assert forward_calls("dots_no_batch") == 2 * forward_calls("dots_no_batch_and_kernels") == 2 * forward_calls("none") == 6


def test_causality():
    model = tiny_model()
    base = _logits(model, IDS)
    t = 11
    changed = IDS.copy()
    changed[:, t] = (changed[:, t] + 7) % 61 + 3
    out = _logits(model, changed)
    # within 1e-6, not bit-equal: the native grouped matmul's OpenBLAS sgemm (on an AMD EPYC's Zen
    # kernels) rounds a row by its expert group's row count, which the changed token moves (3e-8 seen);
    # a causality leak moves the earlier logits by ~1e-2
    np.testing.assert_allclose(out[:, :t], base[:, :t], rtol=0, atol=1e-6)
    assert not np.allclose(out[:, t:], base[:, t:])


def test_packed_documents_equal_documents_alone():
    model = tiny_model()
    lengths = [7, 10, 5]
    seg = np.concatenate([np.full(n, i + 1) for i, n in enumerate(lengths)] + [np.zeros(2, int)])[None]
    ids = IDS[:1, : seg.shape[1]]
    packed = _logits(model, ids, segment_ids=seg)
    start = 0
    for n in lengths:
        alone = _logits(model, ids[:, start:start + n])
        np.testing.assert_allclose(packed[:, start:start + n], alone, atol=2e-5)
        start += n


def test_without_isolation_the_conv_leaks_across_documents():
    model = tiny_model(isolate_documents=False)
    seg = np.repeat([[1, 2]], 12, axis=1).reshape(1, 24)
    seg = np.sort(seg, axis=1)
    packed = _logits(model, IDS[:1], segment_ids=seg)
    alone = _logits(model, IDS[:1, 12:])
    assert not np.allclose(packed[:, 12:], alone, atol=1e-4)


def test_base_skip_slot_passes_scaled_input_native_outputs_zero():
    # With a large skip bias every token takes the skip slot: MoE output is p*x (base) or 0 (native).
    outs = {}
    for layout in ("base", "native"):
        model = tiny_model(layout=layout)
        graphdef, state = nnx.split(model)
        state["layers"]["moe"]["router"]["balancing_biases"][...] = jnp.zeros((2, 5)).at[:, -1].set(10.0)
        skipping = nnx.merge(graphdef, state)
        logits, stats = skipping.forward_with_stats(IDS)
        assert int(np.asarray(stats.expert_counts)[:, -1].sum()) == 2 * IDS.size
        outs[layout] = np.asarray(logits)
    assert not np.allclose(outs["base"], outs["native"])


def test_stats_count_every_real_token_once():
    seg = np.ones_like(IDS)
    seg[:, -4:] = 0
    _, stats = tiny_model().forward_with_stats(IDS, segment_ids=seg)
    counts = np.asarray(stats.expert_counts)
    assert counts.shape == (2, 5)
    assert (counts.sum(axis=1) == int(seg.sum())).all()
    np.testing.assert_allclose(np.asarray(stats.prob_sum).sum(axis=1), seg.sum(), rtol=1e-5)


def test_balancing_biases_are_not_parameters():
    params = nnx.state(tiny_model(), nnx.Param)
    assert "balancing_biases" not in params["layers"]["moe"]["router"]


def test_bf16_compute_runs_close_to_fp32():
    np.testing.assert_allclose(_logits(tiny_model(dtype="bfloat16"), IDS), _logits(tiny_model(), IDS),
                               atol=0.1)


def test_pallas_kernels_in_the_model_match_xla():
    xla = tiny_model(moe_backend="ragged")
    pallas = tiny_model(moe_backend="ragged", attention_kernel="pallas", moe_matmul_kernel="pallas")
    np.testing.assert_allclose(_logits(pallas, IDS[:1, :16]), _logits(xla, IDS[:1, :16]), atol=1e-4)


def test_l2_normalize_has_finite_gradient_at_zero():
    from zaya_jax.model.cca import l2_normalize
    x = jnp.zeros((2, 3, 4)).at[0].set(1.0)
    grad = jax.grad(lambda x: jnp.sum(l2_normalize(x, 2.0) * jnp.arange(4.0)))(x)
    assert np.isfinite(np.asarray(grad)).all()
    np.testing.assert_allclose(l2_normalize(x, 2.0)[0], jnp.ones((3, 4)))
