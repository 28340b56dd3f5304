"""grouped_matmul / grouped_matmuls / transposed_grouped_matmul (Pallas, interpret mode on CPU)
against jax.lax.ragged_dot and its gradients; plus a check that the kernels lower to Triton IR."""

import collections
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import (grouped_matmul, grouped_matmul_reference, grouped_matmuls, lower_for_gpu,
                            transposed_grouped_matmul, transposed_grouped_matmul_reference)


def _inputs(m, k, n, groups, dtype, seed=0):
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
    lhs = jax.random.normal(k1, (m, k), jnp.float32).astype(dtype)
    rhs = jax.random.normal(k2, (groups, k, n), jnp.float32).astype(dtype)
    grad = jax.random.normal(k3, (m, n), jnp.float32).astype(dtype)
    return lhs, rhs, grad


# (m, k, n, group_sizes, tiling (tm, tk, tn), dtype)
CASES = {
    # rows past sum(group_sizes), an empty group, tiles straddling group boundaries
    "ragged_tail_empty_group": (40, 24, 20, [5, 0, 17, 3], (16, 16, 16), jnp.float32),
    # one 16-row tile spanning four groups, empty groups first and last
    "tile_spans_many_groups": (50, 40, 36, [0, 0, 3, 2, 6, 0, 11, 0], (16, 16, 32), jnp.float32),
    "one_token": (1, 16, 16, [0, 1, 0], (16, 16, 16), jnp.float32),
    "all_groups_empty": (24, 16, 16, [0, 0, 0], (16, 16, 16), jnp.float32),
    "bf16_full": (64, 32, 48, [20, 30, 14], (32, 16, 16), jnp.bfloat16),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_matches_ragged_dot(case):
    m, k, n, sizes, tiling, dtype = case
    group_sizes = jnp.asarray(sizes, jnp.int32)
    lhs, rhs, grad = _inputs(m, k, n, len(sizes), dtype)
    kernel = jax.jit(functools.partial(grouped_matmul, group_sizes=group_sizes, tiling=tiling))
    out, vjp = jax.vjp(kernel, lhs, rhs)
    got = (out, *vjp(grad))
    f32 = [x.astype(jnp.float32) for x in (lhs, rhs, grad)]
    ref_out, ref_vjp = jax.vjp(lambda a, b: grouped_matmul_reference(a, b, group_sizes),
                               *f32[:2])
    want = (ref_out, *ref_vjp(f32[2]))
    # bf16: values up to ~25, so one output rounding is up to 0.06
    atol, rtol = (1e-4, 1e-5) if dtype == jnp.float32 else (0.1, 1e-2)
    for name, g, w in zip(("out", "d_lhs", "d_rhs"), got, want, strict=True):
        assert g.dtype == dtype, name
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w), atol=atol,
                                   rtol=rtol, err_msg=name)
    total = int(sum(sizes))
    assert not np.any(np.asarray(out[total:])), "rows past sum(group_sizes) must be zero"


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_two_rhs_in_one_call_match_two_calls_and_ragged_dot(case):
    """grouped_matmuls(lhs, (gate, up)) (one gmm_x2 forward, one summing gmm_transposed_rhs_x2
    backward): outputs and the gradients of lhs (both products' contributions) and of both
    weights equal two grouped_matmul calls and the fp32 reference."""
    m, k, n, sizes, tiling, dtype = case
    group_sizes = jnp.asarray(sizes, jnp.int32)
    lhs, gate, grad_gate = _inputs(m, k, n, len(sizes), dtype, seed=1)
    _, up, grad_up = _inputs(m, k, n, len(sizes), dtype, seed=2)

    def fused(a, g, u):
        return grouped_matmuls(a, (g, u), group_sizes, tiling=tiling)

    def separate(a, g, u):
        return tuple(grouped_matmul(a, w, group_sizes, tiling=tiling) for w in (g, u))

    def reference(a, g, u):
        return tuple(grouped_matmul_reference(a, w, group_sizes) for w in (g, u))

    def values_and_grads(f, *args):
        out, vjp = jax.vjp(jax.jit(f), *args)
        return (*out, *vjp((grad_gate.astype(args[0].dtype), grad_up.astype(args[0].dtype))))

    got = values_and_grads(fused, lhs, gate, up)
    f32 = [x.astype(jnp.float32) for x in (lhs, gate, up)]
    names = ("gate_out", "up_out", "d_lhs", "d_gate", "d_up")
    atol, rtol = (1e-4, 1e-5) if dtype == jnp.float32 else (0.2, 2e-2)  # bf16 d_lhs: two rounded sums
    for want in (values_and_grads(separate, lhs, gate, up), values_and_grads(reference, *f32)):
        for name, g, w in zip(names, got, want, strict=True):
            assert g.dtype == dtype, name
            np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), atol=atol, rtol=rtol,
                                       err_msg=name)
    assert not np.any(np.asarray(got[0][int(sum(sizes)):])), "rows past sum(group_sizes) must be zero"


def test_transposed_matches_reference():
    sizes = jnp.asarray([7, 0, 20, 1], jnp.int32)
    lhs, _, grad = _inputs(33, 24, 40, 4, jnp.float32)
    got = transposed_grouped_matmul(lhs, grad, sizes, tiling=(16, 16, 16))
    want = transposed_grouped_matmul_reference(lhs, grad, sizes)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-5)
    assert not np.any(np.asarray(got[1])), "an empty group's weight gradient is zero"


def test_rejects_mismatched_shapes():
    lhs, rhs, _ = _inputs(8, 16, 16, 2, jnp.float32)
    with pytest.raises(ValueError, match="group_sizes"):
        grouped_matmul(lhs, rhs, jnp.asarray([4, 4, 0], jnp.int32))


@pytest.mark.parametrize("platform", ["cuda", "rocm"])
def test_lowers_to_triton(platform):
    """gmm, transposed-rhs gmm and tgmm lower with the Pallas Triton backend (no GPU needed)."""

    def loss(lhs, rhs, group_sizes):
        out = grouped_matmul(lhs, rhs, group_sizes, interpret=False)
        return out.astype(jnp.float32).sum()

    text = lower_for_gpu(platform, jax.jit(jax.value_and_grad(loss, argnums=(0, 1))),
                         jax.ShapeDtypeStruct((500, 256), jnp.bfloat16),
                         jax.ShapeDtypeStruct((4, 256, 384), jnp.bfloat16),
                         jax.ShapeDtypeStruct((4,), jnp.int32)).as_text()
    for name in ('"gmm"', '"gmm_transposed_rhs"', '"tgmm"'):
        assert f"name = {name}" in text


@pytest.mark.parametrize("platform", ["cuda", "rocm"])
def test_two_rhs_lower_to_one_forward_and_one_input_gradient_call(platform):
    def loss(lhs, gate, up, group_sizes):
        g, u = grouped_matmuls(lhs, (gate, up), group_sizes, interpret=False)
        return (g.astype(jnp.float32) * u.astype(jnp.float32)).sum()

    spec = jax.ShapeDtypeStruct
    text = lower_for_gpu(platform, jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))),
                         spec((500, 256), jnp.bfloat16), spec((4, 256, 384), jnp.bfloat16),
                         spec((4, 256, 384), jnp.bfloat16), spec((4,), jnp.int32)).as_text()
    names = collections.Counter(re.findall(r'name = "(\w+)"', text))
    assert {k: names[k] for k in ("gmm_x2", "gmm_transposed_rhs_x2", "tgmm", "gmm", "gmm_transposed_rhs")} == {
        "gmm_x2": 1, "gmm_transposed_rhs_x2": 1, "tgmm": 2, "gmm": 0, "gmm_transposed_rhs": 0}, names
