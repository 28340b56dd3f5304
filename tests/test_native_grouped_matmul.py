"""The native CPU grouped matmul (zaya_jax.native.grouped_matmul) equals jax.lax.ragged_dot in values
and gradients, and `moe_backend=auto` picks it on CPU (or falls back to `tiles`, warning once)."""

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from zaya_jax.errors import UserError
from zaya_jax.model import kernels
from zaya_jax.native import grouped_matmul as native
from tests.model_fixtures import TINY, tiny_model

# (rows T, group sizes): ragged tail (rows past the sum), empty experts, one token, groups big
# enough to be cut into several row and column pieces across threads
CASES = {
    "ragged_tail": (40, [9, 0, 13, 5]),
    "empty_experts": (24, [0, 24, 0, 0]),
    "one_token": (1, [0, 0, 1, 0]),
    "many_pieces": (300, [120, 0, 100, 30, 20]),
}
# error allowed relative to the array's largest entry: summation order (fp32), a few roundings (bf16)
SCALED_TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}


def test_library_was_built_and_loads():
    assert native.available(), native._load_error()


def _operands(rows, sizes, dtype, k=48, n=200):
    keys = jax.random.split(jax.random.key(rows), 2)
    lhs = jax.random.normal(keys[0], (rows, k)).astype(dtype)
    rhs = jax.random.normal(keys[1], (len(sizes), k, n)).astype(dtype)
    return lhs, rhs, jnp.asarray(sizes, jnp.int32)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_values_and_gradients_equal_ragged_dot(case, dtype):
    rows, sizes = CASES[case]
    lhs, rhs, group_sizes = _operands(rows, sizes, dtype)
    f32 = lambda a: np.asarray(a, np.float32)  # noqa: E731

    def assert_close(a, ref):
        ref = f32(ref)
        np.testing.assert_allclose(f32(a), ref, rtol=0, atol=SCALED_TOL[dtype] * np.abs(ref).max())

    y = jax.jit(native.grouped_matmul)(lhs, rhs, group_sizes)
    y_ref = jax.lax.ragged_dot(lhs, rhs, group_sizes)
    assert y.dtype == dtype
    assert_close(y, y_ref)
    assert np.all(f32(y)[sum(sizes):] == 0), "rows past sum(group_sizes) are zero"

    def loss(matmul, lhs, rhs):
        return jnp.sum(jnp.sin(matmul(lhs, rhs, group_sizes).astype(jnp.float32)))
    grads = jax.jit(jax.grad(lambda a, b: loss(native.grouped_matmul, a, b), argnums=(0, 1)))(lhs, rhs)
    grads_ref = jax.grad(lambda a, b: loss(jax.lax.ragged_dot, a, b), argnums=(0, 1))(lhs, rhs)
    for g, g_ref in zip(grads, grads_ref):
        assert g.dtype == dtype
        assert_close(g, g_ref)
    lhs_grad, rhs_grad = map(f32, grads)
    assert np.all(lhs_grad[sum(sizes):] == 0)
    for e in np.flatnonzero(np.asarray(sizes) == 0):
        assert np.all(rhs_grad[e] == 0), "an empty expert gets a zero weight gradient"
    assert np.any(rhs_grad != 0)


def test_auto_backend_on_cpu_is_native_and_runs_the_model_like_dense():
    assert kernels.resolve_moe_backend("auto", "cpu") == "native"
    ids = np.random.default_rng(0).integers(3, 64, (2, 24))
    logits = [np.asarray(jax.jit(lambda m: m(ids))(tiny_model(moe_backend=b))) for b in ("auto", "dense")]
    np.testing.assert_allclose(logits[0], logits[1], atol=2e-5, rtol=1e-5)


def _ffi_targets(text: str) -> set[str]:
    return {
        name for pair in re.findall(r'custom_call @(zaya_\w+)|custom_call_target="(zaya_\w+)"', text)
        for name in pair if name}


def test_auto_backend_on_cpu_puts_the_native_kernels_in_the_jitted_model():
    """The model's forward and backward pass with moe_backend=auto, jitted on CPU, call the native FFI
    kernels (forward, input gradient, weight gradient) in the lowered and the compiled program: a
    model that silently dispatched `auto` to ragged_dot (same values) fails here."""
    assert kernels.platform() == "cpu"
    ids = np.random.default_rng(0).integers(3, 64, (2, 24))

    def loss(model):
        return jnp.mean(model(ids).astype(jnp.float32) ** 2)

    def lowered(backend):
        return jax.jit(lambda m: nnx.grad(loss)(m)).lower(tiny_model(moe_backend=backend))

    step = lowered("auto")
    for text in (step.as_text(), step.compile().as_text()):
        assert _ffi_targets(text) == set(native._TARGETS), sorted(_ffi_targets(text))
    assert not _ffi_targets(lowered("ragged").as_text())  # the check tells the two backends apart


def test_without_the_library_auto_falls_back_to_tiles_warning_once(monkeypatch):
    monkeypatch.setattr(native, "_library_path", lambda: None)
    native._load_error.cache_clear()
    native._warn_once.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert [kernels.resolve_moe_backend("auto", "cpu") for _ in range(3)] == ["tiles"] * 3
        assert len(caught) == 1 and "not built" in str(caught[0].message)
        with pytest.raises(UserError, match="moe_backend='native'"):
            kernels.moe_dispatch_fn(TINY.replace(moe_backend="native"))
    finally:
        native._load_error.cache_clear()
        native._warn_once.cache_clear()
