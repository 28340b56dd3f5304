"""The train step: a pure function (state, batch) -> (state, metrics), jitted with shardings.

B global batch, M micro-batches, S seq, L layers, E experts (+1 skip).

  micro-batches: batch [B,S] -> [M, B/M, S]; rows are dealt round-robin (row r goes to
      micro-batch r mod M), so every micro-batch keeps the batch's sharding over devices
  lax.scan over micro-batches: grads += d/dparams sum(nll * loss_mask); counts += expert_counts
  grads /= tokens (the loss is the token mean over the whole global batch: accumulating M
      micro-batches gives exactly the gradient of one big batch)
  finite = loss and grad norm are finite
  if finite: params, opt_state <- optimizer (clip by global norm, Muon/AdamW);
             biases <- balancing controller on the global batch's expert counts
  else:      nothing changes but the counters (skipped_steps, nonfinite_streak)

The rope_theta of the current curriculum phase is a static argument: each phase compiles once.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from zaya_jax.parallel.rules import batch_spec
from zaya_jax.train import balancing
from zaya_jax.train.loss import chunked_nll_sum
from zaya_jax.train.optimizer import applied_updates
from zaya_jax.train.state import ModelParts, TrainState

BATCH_KEYS = ("inputs", "targets", "segment_ids", "positions", "loss_mask")


def batch_nll(parts: ModelParts, params: dict, biases: jax.Array, batch: dict, rope_theta: float,
              loss_chunk: int):
    """-> (sum of masked nll [], MoEStats with [L] leading axes) for one batch of [b, S] arrays."""
    model = parts.merge(params, biases)
    hidden, stats = model.hidden_states(batch["inputs"], segment_ids=batch["segment_ids"],
                                        positions=batch["positions"], rope_theta=rope_theta)
    with jax.named_scope("loss_head"):
        return chunked_nll_sum(model.logits, hidden, batch["targets"], batch["loss_mask"], loss_chunk), stats


def split_microbatches(batch: dict, m: int, mesh: Mesh | None) -> dict:
    """{k: [B, S]} -> {k: [M, B/M, S]}, row r in micro-batch r mod M."""
    def one(x):
        x = x.reshape(x.shape[0] // m, m, *x.shape[1:]).swapaxes(0, 1)
        if mesh is None:
            return x
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(None, *batch_spec(mesh, x.ndim - 1))))
    return {k: one(batch[k]) for k in BATCH_KEYS}


def train_step(state: TrainState, batch: dict, *, parts: ModelParts, tx: optax.GradientTransformation,
               controller: optax.GradientTransformation, lr_schedule: Callable, rope_theta: float,
               microbatches: int, loss_chunk: int, balance: bool, include_skip: bool,
               mesh: Mesh | None) -> tuple[TrainState, dict]:
    """One optimizer step on a global batch {inputs, targets, segment_ids, positions, loss_mask: [B, S]}.

    metrics: loss, grad_norm, lr, tokens, skipped (0/1), skipped_steps, nonfinite_streak [];
             expert_counts [L, E+1], dropped [L] (summed over the batch).
    """
    grad_fn = jax.value_and_grad(
        lambda p, mb: batch_nll(parts, p, state.biases, mb, rope_theta, loss_chunk), has_aux=True)

    def micro(carry, mb):
        grads, nll, counts, dropped = carry
        (mb_nll, stats), mb_grads = grad_fn(state.params, mb)
        return (jax.tree.map(jnp.add, grads, mb_grads), nll + mb_nll, counts + stats.expert_counts,
                dropped + stats.dropped), None

    num_layers, num_classes = state.biases.shape
    zeros = (jax.tree.map(jnp.zeros_like, state.params), jnp.zeros((), jnp.float32),
             jnp.zeros((num_layers, num_classes), jnp.int32), jnp.zeros((num_layers,), jnp.int32))
    (grads, nll, counts, dropped), _ = jax.lax.scan(micro, zeros, split_microbatches(batch, microbatches, mesh))
    tokens = jnp.sum(batch["loss_mask"])
    denom = jnp.maximum(tokens, 1.0)
    loss = nll / denom
    grads = jax.tree.map(lambda g: g / denom, grads)
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)

    def apply(s: TrainState) -> TrainState:
        with jax.named_scope("optimizer"):
            updates, opt_state = tx.update(grads, s.opt_state, s.params)
            params = optax.apply_updates(s.params, updates)
        biases, controller_state = s.biases, s.controller_state
        if balance:
            with jax.named_scope("balancing"):
                biases, controller_state = balancing.update_biases(s.biases, s.controller_state, counts, controller,
                                                                   include_skip)
        return s.replace(params=params, opt_state=opt_state, biases=biases,
                         controller_state=controller_state, nonfinite_streak=jnp.zeros_like(s.nonfinite_streak))

    def skip(s: TrainState) -> TrainState:
        return s.replace(skipped_steps=s.skipped_steps + 1, nonfinite_streak=s.nonfinite_streak + 1)

    applied_before = applied_updates(state.opt_state, state.step - state.skipped_steps)
    new = jax.lax.cond(finite, apply, skip, state)
    new = new.replace(step=state.step + 1,
                      rng=jax.random.key_data(jax.random.split(jax.random.wrap_key_data(state.rng))[0]))
    metrics = {"loss": loss, "grad_norm": grad_norm, "lr": lr_schedule(applied_before), "tokens": tokens,
               "skipped": (~finite).astype(jnp.int32), "skipped_steps": new.skipped_steps,
               "nonfinite_streak": new.nonfinite_streak, "expert_counts": counts, "dropped": dropped}
    return new, metrics


def eval_step(params: dict, biases: jax.Array, batch: dict, *, parts: ModelParts, rope_theta: float,
              loss_chunk: int) -> tuple[jax.Array, jax.Array]:
    """-> (sum of masked nll [], target tokens []) of one evaluation batch."""
    nll, _ = batch_nll(parts, params, biases, batch, rope_theta, loss_chunk)
    return nll, jnp.sum(batch["loss_mask"])


def jit_train_step(state_shardings: TrainState, mesh: Mesh, **static) -> Callable:
    """(state, batch, rope_theta) -> (state, metrics), compiled once per rope_theta; the state is donated."""
    batch_sharding = {k: NamedSharding(mesh, batch_spec(mesh)) for k in BATCH_KEYS}
    replicated = NamedSharding(mesh, P())
    fn = functools.partial(train_step, mesh=mesh, **static)

    def run_train_step(state, batch, rope_theta):  # the name profiles show
        return fn(state, batch, rope_theta=rope_theta)
    return jax.jit(run_train_step, in_shardings=(state_shardings, batch_sharding),
                   out_shardings=(state_shardings, replicated), static_argnums=2, donate_argnums=0)


def jit_eval_step(params_shardings: dict, biases_sharding: NamedSharding, mesh: Mesh, **static) -> Callable:
    """(params, biases, batch, rope_theta) -> (nll sum, tokens)."""
    batch_sharding = {k: NamedSharding(mesh, batch_spec(mesh)) for k in BATCH_KEYS}
    fn = functools.partial(eval_step, **static)

    def run_eval_step(params, biases, batch, rope_theta):
        return fn(params, biases, batch, rope_theta=rope_theta)
    return jax.jit(run_eval_step, in_shardings=(params_shardings, biases_sharding, batch_sharding),
                   out_shardings=NamedSharding(mesh, P()), static_argnums=3)
