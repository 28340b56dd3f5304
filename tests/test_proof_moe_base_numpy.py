"""Proof of the base layout's MoE block (skip slot passes p * x) against numpy written from the spec.

transformers implements only the native layout (skip outputs 0), so the base rule is checked
here against zaya1-spec section 2.2, re-derived in a few lines of numpy: router (down-proj with
bias, EDA, RMSNorm, erf-GELU MLP, fp32 softmax, top-1 over p + bias), SwiGLU experts with the
unbiased probability as weight, and the skip slot returning p_skip * x. Every parameter is
random and the skip slot is taken by a share of the tokens (asserted).
"""

import jax
import numpy as np
import pytest
from flax import nnx
from scipy.special import erf

from tests.model_fixtures import TINY
from zaya_jax.model.kernels import moe_dispatch_fn
from zaya_jax.model.moe import MoE

CFG = TINY.replace(hidden_size=36, num_experts=5, moe_intermediate_size=10, router_hidden_size=7, layout="base")


def _gelu(x):
    return 0.5 * x * (1 + erf(x / np.sqrt(2)))


def numpy_moe(p, x, prev, eps):
    """x [T,D], prev [T,R], p: our parameter dict (as numpy) -> y [T,D], next state [T,R], choice [T]."""
    rt = p["router"]
    r = x @ rt["down_proj"] + rt["down_bias"] + rt["state_scale"] * prev
    u = r / np.sqrt(np.mean(r * r, -1, keepdims=True) + eps) * rt["norm"]
    h = _gelu(_gelu(u @ rt["fc1"] + rt["fc1_bias"]) @ rt["fc2"] + rt["fc2_bias"])
    logits = h @ rt["out_proj"]
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    choice = np.argmax(probs + rt["balancing_biases"], -1)
    y = np.zeros_like(x)
    for t, e in enumerate(choice):
        if e == len(p["gate"]):  # skip slot, base layout: the normed input scaled by its probability
            y[t] = probs[t, e] * x[t]
        else:
            g, up = x[t] @ p["gate"][e], x[t] @ p["up"][e]
            y[t] = probs[t, e] * ((g / (1 + np.exp(-g)) * up) @ p["down"][e])
    return y, r, choice


def _random_moe(seed):
    moe = MoE(CFG, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(seed)
    graphdef, state = nnx.split(moe)
    pure = jax.tree.map(lambda a: rng.normal(0, 0.5, a.shape).astype(np.float32), nnx.to_pure_dict(state))
    pure["router"]["norm"] = 1 + 0.2 * pure["router"]["norm"]
    pure["router"]["balancing_biases"] = 0.1 * pure["router"]["balancing_biases"]
    pure["router"]["balancing_biases"][-1] = 0.1  # the skip slot wins a share of the tokens
    nnx.replace_by_pure_dict(state, pure)
    return nnx.merge(graphdef, state), pure


@pytest.mark.parametrize("backend", ["dense", "tiles", "ragged"])
def test_base_layout_moe_block_matches_numpy_with_skip_tokens(backend):
    moe, params = _random_moe(seed=5)
    rng = np.random.default_rng(6)
    x = rng.normal(size=(2, 23, CFG.hidden_size)).astype(np.float32)
    prev = rng.normal(size=(2, 23, CFG.router_hidden_size)).astype(np.float32)
    dispatch = moe_dispatch_fn(CFG.replace(moe_backend=backend))
    y, state, stats = jax.jit(lambda m, a, b: m(a, b, np.ones(a.shape[:2], bool), dispatch))(moe, x, prev)

    ref_y, ref_state, ref_choice = numpy_moe(params, x.reshape(-1, CFG.hidden_size),
                                             prev.reshape(-1, CFG.router_hidden_size), CFG.router_norm_eps)
    skipped = int((ref_choice == CFG.num_experts).sum())
    assert 0 < skipped < ref_choice.size, f"skip-slot tokens: {skipped} of {ref_choice.size}"
    assert len(set(ref_choice.tolist())) >= 4, "routing must spread over several experts"
    np.testing.assert_array_equal(np.asarray(stats.expert_counts),
                                  np.bincount(ref_choice, minlength=CFG.num_router_classes))
    np.testing.assert_allclose(np.asarray(state).reshape(ref_state.shape), ref_state, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(y).reshape(ref_y.shape), ref_y, atol=2e-5, rtol=1e-4)
