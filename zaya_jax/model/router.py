"""The ZAYA1 router (zaya1-spec section 2.2).

  1. r = x W_down + b_down                          [B,S,R]
  2. EDA: r += gamma * r_prev (router state of the previous MoE block; zeros for the first)
  3. u = RMSNorm(r)   (r itself, pre-norm, is the state handed to the next MoE block)
  4. logits = W3 gelu(W2 gelu(W1 u + b1) + b2)     [B,S,E+1]  (exact-erf GELU)
  5. p = softmax(logits) in fp32
  6. choice = argmax(stop_grad(p) + balancing_bias): the bias steers the choice only
  7. weight = p[choice], unbiased and not renormalised; gradient flows through it.
Index E is the skip (Mixture-of-Depths) slot. The router runs in fp32 whatever the compute dtype
(as Zyphra's): in bf16, near-tie top-1 choices flip, and a flip compounds over 40 layers through
the router state. Its matrices are small (D x R, R x R), so fp32 costs little.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from zaya_jax.config import ModelConfig
from zaya_jax.model.norms import rms_norm
from zaya_jax.model.params import BalancingBias, constant, normal, param


class Routing(NamedTuple):
    choice: jax.Array        # [B,S] int32 in [0, E]; E = skip
    weight: jax.Array        # [B,S] float32, p[choice]
    probs: jax.Array         # [B,S,E+1] float32
    next_state: jax.Array    # [B,S,R], pre-norm router state for the next MoE block


def initial_balancing_biases(num_router_classes: int) -> jax.Array:
    """Zeros, except the skip slot at -1 (as Zyphra's code)."""
    return jnp.zeros((num_router_classes,), jnp.float32).at[-1].set(-1.0)


class Router(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, r, e = cfg.hidden_size, cfg.router_hidden_size, cfg.num_router_classes
        init = normal(cfg.init_std)
        self.down_proj = param(init, rngs.params(), (d, r), ("embed", "router"))
        self.down_bias = constant(0.0, (r,), ("router",))
        self.state_scale = constant(1.0, (r,), ("router",))
        self.norm = constant(1.0, (r,), ("router",))
        self.fc1 = param(init, rngs.params(), (r, r), ("router", None))
        self.fc1_bias = constant(0.0, (r,), (None,))
        self.fc2 = param(init, rngs.params(), (r, r), (None, "router"))
        self.fc2_bias = constant(0.0, (r,), ("router",))
        self.out_proj = param(init, rngs.params(), (r, e), ("router", "router_classes"))
        self.balancing_biases = BalancingBias(initial_balancing_biases(e), out_sharding=("router_classes",),
                                              eager_sharding=False)
        self.norm_eps = cfg.router_norm_eps

    def __call__(self, x: jax.Array, prev_state: jax.Array) -> Routing:
        """x: [B,S,D] normed input; prev_state: [B,S,R] (zeros before the first MoE block).

        Computed in fp32; next_state comes back in prev_state's dtype (the carried stream's)."""
        dt = jnp.float32
        w = lambda p: p[...].astype(dt)  # noqa: E731
        state = x.astype(dt) @ w(self.down_proj) + w(self.down_bias) + w(self.state_scale) * prev_state.astype(dt)
        u = rms_norm(state, self.norm[...], self.norm_eps, dt)
        hidden = jax.nn.gelu(u @ w(self.fc1) + w(self.fc1_bias), approximate=False)
        hidden = jax.nn.gelu(hidden @ w(self.fc2) + w(self.fc2_bias), approximate=False)
        probs = jax.nn.softmax((hidden @ w(self.out_proj)).astype(jnp.float32), axis=-1)
        biased = jax.lax.stop_gradient(probs) + jax.lax.stop_gradient(self.balancing_biases[...])
        choice = jnp.argmax(biased, axis=-1).astype(jnp.int32)
        weight = jnp.take_along_axis(probs, choice[..., None], axis=-1)[..., 0]
        return Routing(choice, weight, probs, state.astype(prev_state.dtype))
