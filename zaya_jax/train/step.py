"""The train step: a pure function (state, batch) -> (state, metrics), jitted with shardings.

B global batch, M micro-batches, S seq, L layers, E experts (+1 skip).

  micro-batches: batch [B,S] -> [M, B/M, S]; rows are dealt round-robin (row r goes to
      micro-batch r mod M), so every micro-batch keeps the batch's sharding over devices
  lax.scan over micro-batches (objectives.py: lm / sft / dpo / grpo):
      lm, sft: value = sum(nll * token weights), the loss head's gradient computed with its
               forward (loss.weighted_nll_sum); value, sums = objective.weighted_sums(value, micro-batch)
      dpo, grpo: nll = per-token nll of the policy [b,S] and of the frozen reference (stop_gradient;
               GRPO's only with a KL; GRPO's loss head runs on its completions' columns alone, from
               objective.scored_from on: the nll before is 0); value, sums = objective.micro_sums(nll,
               reference nll, micro-batch)
               (a GRPO batch also carries advantages [B,S] and, with num_iterations > 1, old_logp [B,S])
      grads += d value / d params; sums += sums; counts += expert_counts
  with mesh.gradient_reduce_dtype != 'float32' and data > 1: the scan runs on each data rank's own
      rows, and grads, sums, counts are summed over data once after it, the grads in that dtype
      (parallel/gradient_reduce.py); else the partitioner reduces each micro-batch's grads in float32
  grads /= count (masked tokens, or valid DPO pairs, of the whole global batch: accumulating M
      micro-batches gives exactly the gradient of one big batch); metrics = objective.metrics(sums)
  finite = loss and grad norm are finite
  if finite: params, opt_state <- optimizer (clip by global norm, Muon/AdamW);
             biases <- balancing controller on the global batch's expert counts
  else:      nothing changes but the counters (skipped_steps, nonfinite_streak)

The rope_theta of the current curriculum phase is a static argument: each phase compiles once.

A vision-language run (parts of a ZayaVL) takes the image keys too (patches [B, P, F], ...: the
tower runs on each micro-batch's patches and its tokens replace the placeholders), logs
image_token_share (image placeholders / non-padding positions of the batch), and with `frozen`
(train.freeze_text) stops the gradient at those parameters: their weight gradients are not
computed, and they are exactly zero.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from zaya_jax.data.vision.image_rows import IMAGE_KEYS
from zaya_jax.model.vision.vl import ImageBatch
from zaya_jax.model.zaya import tied_logits
from zaya_jax.parallel.context import current_mesh_shape
from zaya_jax.parallel.gradient_reduce import GradientReduce, summed_over_data
from zaya_jax.parallel.rules import batch_spec
from zaya_jax.train import balancing
from zaya_jax.train.loss import chunked_token_nll, weighted_nll_sum
from zaya_jax.train.objectives import TokenObjective, zero_sums
from zaya_jax.train.optimizer import applied_updates, path_name
from zaya_jax.checkpoints.model_parts import ModelParts
from zaya_jax.train.state import TrainState


def batch_hidden(parts: ModelParts, params: dict, biases: jax.Array, batch: dict, rope_theta: float):
    """-> (text model, final-normed hidden [b, S, D], MoEStats with [L] leading axes) for one batch
    of [b, S] arrays (and a vision model's [b, P, ...] image arrays)."""
    model = parts.merge(params, biases)
    text = dict(segment_ids=batch["segment_ids"], positions=batch["positions"], rope_theta=rope_theta)
    if parts.image_id is None:
        return (model, *model.hidden_states(batch["inputs"], **text))
    images = ImageBatch(*(batch[k] for k in IMAGE_KEYS))
    return (model.text, *model.hidden_states(batch["inputs"], images, **text))


def image_token_share(batch: dict, image_id: int) -> jax.Array:
    """[] the share of a batch's non-padding positions that are image placeholders."""
    real = batch["segment_ids"] > 0
    return jnp.sum((batch["inputs"] == image_id) & real) / jnp.maximum(jnp.sum(real), 1)


def stop_frozen(params: dict, frozen: Callable[[str], bool] | None) -> dict:
    """params with the gradient stopped at every parameter whose path name `frozen` holds."""
    if frozen is None:
        return params
    return jax.tree_util.tree_map_with_path(
        lambda path, x: jax.lax.stop_gradient(x) if frozen(path_name(path)) else x, params)


def batch_nll(parts: ModelParts, params: dict, biases: jax.Array, batch: dict, rope_theta: float,
              loss_chunk: int, scored_from: int = 0):
    """-> (per-token nll [b, S], MoEStats with [L] leading axes) for one batch of [b, S] arrays; the
    loss head runs on columns [scored_from, S) only (the nll of the columns before is 0)."""
    model, hidden, stats = batch_hidden(parts, params, biases, batch, rope_theta)
    with jax.named_scope("loss_head"):
        nll = chunked_token_nll(model.logits, hidden[:, scored_from:], batch["targets"][:, scored_from:], loss_chunk)
        return jnp.pad(nll, ((0, 0), (scored_from, 0))), stats


def reference_nll(parts: ModelParts, reference: dict | None, batch: dict, rope_theta: float, loss_chunk: int,
                  scored_from: int = 0):
    """The frozen reference model's per-token nll [b, S] (no gradient; 0 before column scored_from),
    or None without a reference."""
    if reference is None:
        return None
    with jax.named_scope("reference_model"):
        nll, _ = batch_nll(parts, reference["params"], reference["biases"], batch, rope_theta, loss_chunk,
                           scored_from)
        return jax.lax.stop_gradient(nll)


def objective_value(parts: ModelParts, objective, params: dict, biases: jax.Array, reference: dict | None,
                    batch: dict, rope_theta: float, loss_chunk: int):
    """-> (value [] to differentiate, (sums {objective.sum_keys: []}, MoEStats)) of one micro-batch."""
    if objective.linear_in_nll:
        model, hidden, stats = batch_hidden(parts, params, biases, batch, rope_theta)
        with jax.named_scope("loss_head"):
            value = weighted_nll_sum(functools.partial(tied_logits, dtype=model.config.dtype), hidden,
                                     model.embed[...], batch["targets"], objective.token_weights(batch), loss_chunk)
        value, sums = objective.weighted_sums(value, batch)
        return value, (sums, stats)
    ref_nll = reference_nll(parts, reference, batch, rope_theta, loss_chunk, objective.scored_from)
    nll, stats = batch_nll(parts, params, biases, batch, rope_theta, loss_chunk, objective.scored_from)
    value, sums = objective.micro_sums(nll, ref_nll, batch)
    return value, (sums, stats)


def split_microbatches(batch: dict, m: int) -> dict:
    """{k: [B, ...]} -> {k: [M, B/M, ...]}, row r in micro-batch r mod M, each micro-batch sharded
    as the batch over the active mesh (its axes that are not manual)."""
    shape = current_mesh_shape()

    def one(x):
        x = x.reshape(x.shape[0] // m, m, *x.shape[1:]).swapaxes(0, 1)
        if not shape:
            return x
        return jax.lax.with_sharding_constraint(x, P(None, *batch_spec(shape, x.ndim - 1)))
    return {k: one(x) for k, x in batch.items()}


def batch_shardings(mesh: Mesh, parts: ModelParts, objective=TokenObjective()) -> dict[str, NamedSharding]:
    """{batch key: its NamedSharding} of the batch a step of `parts` and `objective` takes
    (distributed.global_batch's: a vision-language run has mesh.context = 1, so its patches are not split)."""
    ndim = {"patches": 3, "patch_positions": 3}
    return {k: NamedSharding(mesh, batch_spec(mesh, ndim.get(k, 2)))
            for k in parts.batch_keys + objective.extra_batch_keys}


def train_step(state: TrainState, batch: dict, *, parts: ModelParts, tx: optax.GradientTransformation,
               controller: optax.GradientTransformation, lr_schedule: Callable, rope_theta: float,
               microbatches: int, loss_chunk: int, balance: bool, include_skip: bool,
               mesh: Mesh | None, objective=TokenObjective(),
               gradient_reduce: GradientReduce | None = None,
               frozen: Callable[[str], bool] | None = None) -> tuple[TrainState, dict]:
    """One optimizer step on a global batch {inputs, targets, segment_ids, positions, loss_mask: [B, S]}.

    gradient_reduce: sum the gradients over mesh `data` (of size > 1) by hand in its dtype (None: the
    partitioner reduces them; program.build_program passes one where gradient_reduce.summed_by_hand).
    frozen: parameter path name -> True where the gradient stops (None: every parameter trains).

    metrics: objective.metric_keys (loss; for dpo also reward_margin, reward_accuracy,
             chosen_reward, rejected_reward, pairs), grad_norm, lr, tokens, skipped (0/1),
             skipped_steps, nonfinite_streak [] (and image_token_share [] for a vision model);
             expert_counts [L, E+1], dropped [L] (summed over the batch).
    """
    def accumulated(params, fixed, batch):
        """-> (grads summed over the micro-batches of `batch`, (sums, expert counts, dropped))."""
        biases, reference = fixed
        grad_fn = jax.value_and_grad(
            lambda p, mb: objective_value(parts, objective, stop_frozen(p, frozen), biases, reference, mb,
                                          rope_theta, loss_chunk),
            has_aux=True)

        def micro(carry, mb):
            grads, sums, counts, dropped = carry
            (_, (mb_sums, stats)), mb_grads = grad_fn(params, mb)
            return (jax.tree.map(jnp.add, grads, mb_grads), jax.tree.map(jnp.add, sums, mb_sums),
                    counts + stats.expert_counts, dropped + stats.dropped), None

        num_layers, num_classes = biases.shape
        zeros = (jax.tree.map(jnp.zeros_like, params), zero_sums(objective),
                 jnp.zeros((num_layers, num_classes), jnp.int32), jnp.zeros((num_layers,), jnp.int32))
        (grads, *extras), _ = jax.lax.scan(micro, zeros, split_microbatches(batch, microbatches))
        return grads, tuple(extras)

    fixed = (state.biases, state.reference)
    if gradient_reduce is not None:
        grads, (sums, counts, dropped) = summed_over_data(accumulated, state.params, fixed, batch, mesh=mesh,
                                                          reduce=gradient_reduce)
    else:
        grads, (sums, counts, dropped) = accumulated(state.params, fixed, batch)
    objective_metrics = objective.metrics(sums)
    loss = objective_metrics["loss"]
    denom = jnp.maximum(sums[objective.count_key], 1.0)
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
    metrics = {**objective_metrics, "grad_norm": grad_norm, "lr": lr_schedule(applied_before),
               "tokens": jnp.sum(batch["loss_mask"]),
               "skipped": (~finite).astype(jnp.int32), "skipped_steps": new.skipped_steps,
               "nonfinite_streak": new.nonfinite_streak, "expert_counts": counts, "dropped": dropped}
    if parts.image_id is not None:
        metrics["image_token_share"] = image_token_share(batch, parts.image_id)
    return new, metrics


def eval_step(params: dict, biases: jax.Array, reference: dict | None, batch: dict, *, parts: ModelParts,
              rope_theta: float, loss_chunk: int, objective=TokenObjective()) -> dict:
    """-> the objective's sums {objective.sum_keys: []} over one evaluation batch (objective.metrics
    of their totals over many batches is the held-out loss)."""
    _, (sums, _) = objective_value(parts, objective, params, biases, reference, batch, rope_theta, loss_chunk)
    return sums


def jit_train_step(state_shardings: TrainState, mesh: Mesh, **static) -> Callable:
    """(state, batch, rope_theta) -> (state, metrics), compiled once per rope_theta; the state is donated."""
    batch_sharding = batch_shardings(mesh, static["parts"], static["objective"])
    replicated = NamedSharding(mesh, P())
    fn = functools.partial(train_step, mesh=mesh, **static)

    def run_train_step(state, batch, rope_theta):  # the name profiles show
        return fn(state, batch, rope_theta=rope_theta)
    return jax.jit(run_train_step, in_shardings=(state_shardings, batch_sharding),
                   out_shardings=(state_shardings, replicated), static_argnums=2, donate_argnums=0)


def jit_token_logps(params_shardings: dict, biases_sharding: NamedSharding, mesh: Mesh, *, parts: ModelParts,
                    loss_chunk: int, scored_from: int = 0) -> Callable:
    """(params, biases, batch {BATCH_KEYS: [B,S]}, rope_theta) -> per-token log-probs of the targets
    [B,S], 0 before column scored_from (GRPO's sampling weights' old_logp: train/grpo_batches.py)."""
    def run_token_logps(params, biases, batch, rope_theta):
        nll, _ = batch_nll(parts, params, biases, batch, rope_theta, loss_chunk, scored_from)
        return -nll
    return jax.jit(run_token_logps, in_shardings=(params_shardings, biases_sharding, batch_shardings(mesh, parts)),
                   out_shardings=NamedSharding(mesh, batch_spec(mesh)), static_argnums=3)


def jit_eval_step(params_shardings: dict, biases_sharding: NamedSharding, mesh: Mesh,
                  reference_shardings: dict | None = None, **static) -> Callable:
    """(params, biases, reference, batch, rope_theta) -> the objective's sums; reference: the
    frozen {params, biases} of a DPO run, else None."""
    batch_sharding = batch_shardings(mesh, static["parts"], static["objective"])
    fn = functools.partial(eval_step, **static)

    def run_eval_step(params, biases, reference, batch, rope_theta):
        return fn(params, biases, reference, batch, rope_theta=rope_theta)
    return jax.jit(run_eval_step, in_shardings=(params_shardings, biases_sharding, reference_shardings,
                                                batch_sharding),
                   out_shardings=NamedSharding(mesh, P()), static_argnums=4)
