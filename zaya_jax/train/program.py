"""What a config compiles to: the optimizer, the abstract train state, its shardings and the
jitted train/eval steps on a mesh, built from shapes alone (no array is allocated).

The Trainer runs it; tests/test_gpu_lowering.py lowers the same train step for CUDA and ROCm
from a CPU process (`abstract_batch` gives the batch's shapes).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh

from zaya_jax.model.vision.vl import build_model
from zaya_jax.parallel.gradient_reduce import GradientReduce, check_mesh, summed_by_hand
from zaya_jax.parallel.rules import check_axes_divide
from zaya_jax.train import balancing
from zaya_jax.train.objectives import make_objective
from zaya_jax.train.optimizer import make_optimizer, schedule, text_weight
from zaya_jax.train.settings import Settings
from zaya_jax.checkpoints.model_parts import BATCH_KEYS, ModelParts
from zaya_jax.parallel.rules import to_shardings
from zaya_jax.train.state import TrainState, initial_state, state_specs
from zaya_jax.train.step import jit_eval_step, jit_token_logps, jit_train_step


@dataclasses.dataclass(frozen=True)
class TrainProgram:
    parts: ModelParts
    tx: optax.GradientTransformation
    controller: optax.GradientTransformation
    lr_schedule: Callable
    abstract_state: TrainState   # of ShapeDtypeStructs
    shardings: TrainState        # of NamedShardings
    train_step: Callable         # (state, batch, rope_theta) -> (state, metrics)
    eval_step: Callable          # (params, biases, reference, batch, rope_theta) -> the objective's sums
    token_logps: Callable        # (params, biases, batch, rope_theta) -> per-token log-probs [B,S] (GRPO)
    objective: object            # objectives.TokenObjective | DPOObjective | GRPOObjective


def model_shapes(s: Settings) -> nnx.Module:
    """The model `s` describes, as shapes (nnx.eval_shape: nothing allocated)."""
    return nnx.eval_shape(lambda: build_model(s.model, s.vision, rngs=nnx.Rngs(s.train.seed)))


def check_mesh_divides_model(s: Settings, mesh_shape: dict[str, int]) -> None:
    """Each mesh axis divides the parameter dimensions it shards (rules.check_axes_divide: a ConfigError
    naming the config's mesh field and the sizes that divide)."""
    check_axes_divide([nnx.state(model_shapes(s))], mesh_shape, "mesh",
                      lambda axis, size: f"--config.mesh.{axis}={size}")


def build_program(s: Settings, mesh: Mesh) -> TrainProgram:
    frozen = text_weight if s.train.freeze_text else None
    tx = make_optimizer(s.optimizer, s.train.steps, frozen)
    controller = balancing.make_controller(s.balancing)
    lr_schedule = schedule(s.optimizer, s.train.steps, s.optimizer.learning_rate)
    abstract_model = model_shapes(s)
    parts = ModelParts(abstract_model)
    params_abs, biases_abs = ModelParts.arrays(abstract_model)
    objective = make_objective(s)
    abstract_state = jax.eval_shape(
        lambda p, b: initial_state(p, b, tx, controller, s.train.seed, objective.needs_reference),
        params_abs, biases_abs)
    specs = state_specs(abstract_state, parts.param_specs(mesh), parts.biases_spec(mesh), mesh,
                        s.mesh.shard_optimizer_over_data)
    shardings = to_shardings(specs, mesh)
    static = dict(parts=parts, loss_chunk=s.train.loss_chunk_size, objective=objective)
    check_mesh(dict(mesh.shape), s.mesh.gradient_reduce_dtype)
    reduce = (GradientReduce(s.mesh.gradient_reduce_dtype, specs.params, s.mesh.shard_optimizer_over_data)
              if summed_by_hand(dict(mesh.shape), s.mesh.gradient_reduce_dtype) else None)
    train_step = jit_train_step(
        shardings, mesh, tx=tx, controller=controller, lr_schedule=lr_schedule, microbatches=s.train.microbatches,
        balance=s.balancing.enabled and not s.train.freeze_text, include_skip=s.balancing.include_skip,
        gradient_reduce=reduce, frozen=frozen, **static)
    eval_step = jit_eval_step(shardings.params, shardings.biases, mesh, shardings.reference, **static)
    token_logps = jit_token_logps(shardings.params, shardings.biases, mesh, parts=parts,
                                  loss_chunk=s.train.loss_chunk_size, scored_from=objective.scored_from)
    return TrainProgram(parts, tx, controller, lr_schedule, abstract_state, shardings, train_step, eval_step,
                        token_logps, objective)


def abstract_batch(global_batch_size: int, seq_len: int, images: tuple[int, int] | None = None,
                   extra_keys: tuple[str, ...] = ()) -> dict[str, jax.ShapeDtypeStruct]:
    """The shapes of one global batch {inputs, targets, segment_ids, positions, loss_mask: [B, S]};
    images (P, F): a vision-language run's too (patches [B, P, F], patch_positions [B, P, 2],
    image_segments and window_segments [B, P]); extra_keys: the objective's float32 [B, S] arrays
    (objective.extra_batch_keys: GRPO's advantages, old_logp)."""
    batch = {k: jax.ShapeDtypeStruct((global_batch_size, seq_len), jnp.float32 if k == "loss_mask" else jnp.int32)
             for k in BATCH_KEYS}
    batch |= {k: jax.ShapeDtypeStruct((global_batch_size, seq_len), jnp.float32) for k in extra_keys}
    if images is not None:
        p, f = images
        batch |= {"patches": jax.ShapeDtypeStruct((global_batch_size, p, f), jnp.float32),
                  "patch_positions": jax.ShapeDtypeStruct((global_batch_size, p, 2), jnp.int32),
                  "image_segments": jax.ShapeDtypeStruct((global_batch_size, p), jnp.int32),
                  "window_segments": jax.ShapeDtypeStruct((global_batch_size, p), jnp.int32)}
    return batch


def image_shape(s: Settings) -> tuple[int, int] | None:
    """(patches per row, features per patch) of a vision-language run's batches, or None."""
    return None if s.vision is None else (s.train.patch_capacity, s.vision[0].patch_dim)
