"""The router balancing controller (zaya1-spec 2.1): AdamW on the load error, outside autograd.

Per MoE layer l and expert e, over the global batch (expert_counts are already summed over every
device's tokens by GSPMD):

  p[l, e]    = tokens routed to e / tokens routed to any balanced slot       [L, E']
  error      = p - 1/E'                                                       [L, E']
  biases    <- biases + AdamW(error)        (over-used experts, error > 0, are pushed down)

E' = E real experts, or E + 1 when balancing.include_skip (then the skip slot is balanced like an
expert). Otherwise the skip slot's error is 0 and its bias never moves (it stays -1, as in every
released ZAYA1 checkpoint). The AdamW state is the controller's own (optax.adamw, no weight
decay), checkpointed with the model.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from zaya_jax.train.settings import BalancingSettings


def make_controller(settings: BalancingSettings) -> optax.GradientTransformation:
    return optax.adamw(settings.rate, b1=settings.b1, b2=settings.b2, weight_decay=0.0)


def load_error(expert_counts: jax.Array, include_skip: bool) -> jax.Array:
    """expert_counts [L, E+1] (skip last) -> error [L, E+1]: load fraction - 1/E' (0 where unbalanced)."""
    counts = expert_counts.astype(jnp.float32)
    balanced = counts if include_skip else counts[:, :-1]
    n = balanced.shape[-1]
    total = jnp.maximum(jnp.sum(balanced, axis=-1, keepdims=True), 1.0)
    error = balanced / total - 1.0 / n
    if include_skip:
        return error
    return jnp.concatenate([error, jnp.zeros_like(counts[:, -1:])], axis=-1)


def update_biases(biases: jax.Array, controller_state: optax.OptState, expert_counts: jax.Array,
                  tx: optax.GradientTransformation, include_skip: bool) -> tuple[jax.Array, optax.OptState]:
    """biases [L, E+1], expert_counts [L, E+1] -> new biases, new controller state."""
    error = jax.lax.stop_gradient(load_error(expert_counts, include_skip))
    updates, controller_state = tx.update(error, controller_state, biases)
    if not include_skip:
        updates = updates.at[:, -1].set(0.0)
    return biases + updates, controller_state
