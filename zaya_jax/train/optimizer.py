"""Optimizers (Muon + AdamW as Zyphra trained ZAYA1, or AdamW alone), schedules, decay masks.

Parameters are a nested dict of arrays (nnx.to_pure_dict of the model's nnx.Param state) with
leading stacked axes: [L, ...] for every layer parameter and [L, E, ...] for the experts.

Muon (optax.contrib.scale_by_muon) takes the matrix parameters listed in MUON_MATRICES: each
entry says which trailing axes are the matrix's input (reduction) and output dims; every
leading axis (layers, experts) is a batch axis, so Newton-Schulz orthogonalises each layer's
(and each expert's) own matrix, never the stack. Updates are RMS-matched to AdamW
(Moonlight, arXiv 2502.16982): scaled by muon_rms_scale * sqrt(max(fan_in, fan_out)).
AdamW takes everything else: the embedding (tied with the output head), norms, biases,
residual scales, key temperatures and the small CCA convolutions.

Distributed Muon (optimizer.muon_distributed, off by default): Newton-Schulz is per matrix, so
no data-parallel replica needs to repeat it. Muon always runs on each parameter as a [B, m, n]
stack of its matrices (layers x experts flattened); with the option, under a mesh whose
data-parallel group (rules.zero1_axes: data x context, ZeRO-1's group) has R > 1 ranks (the
trainer's step), the stack is zero-padded to a multiple of R and sharded over the group: every
data-parallel rank orthogonalises ceil(B / R) of the matrices, and the partitioner moves the
updates back to the parameters' sharding (as_matrices, from_matrices: one all-to-all each way
from and to a ZeRO-1 slice). The update equals single-device Muon (tests/test_train_optimizer.py
and, for whole training steps, tests/test_proof_sharded_training.py, with the per-device batch of
the compiled Newton-Schulz matmuls as proof that the work is split). On in configs/zaya1_base.py,
where without it every Newton-Schulz matmul gathers its whole operand (docs/training.md,
tests/test_muon_traffic.py); off by default and in the CPU configs: on 8 fake CPU devices under
load, XLA:CPU's in-process all-reduce rendezvous timed out with an earlier version of it (a DPO
resume test, 2 of 3 runs on 2 loaded cores; 0 of 1 without it).

Weight decay: matrices, convolution kernels and (if optimizer.decay_embedding) the embedding;
never norms, biases, scales or temperatures. Both groups share the schedule's shape; AdamW's
peak is optimizer.adam_learning_rate (0: the same as Muon's).

A vision-language run's parameters are {text: the text model's, vision: the tower's}: the text
model's are grouped as above (their names without the `text/` prefix); the tower, its merger and
the vision LoRA train with AdamW, their kernels decayed. With `frozen` (train.freeze_text) the
frozen parameters get no update and keep no optimizer state (optax.set_to_zero).
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P
from optax.contrib import MuonDimensionNumbers, scale_by_muon

from zaya_jax.parallel.rules import with_zero1_axes, zero1_axes
from zaya_jax.train.settings import OptimizerSettings

# parameter path -> (reduction axes, output axes), counted from the end.
MUON_MATRICES: dict[str, MuonDimensionNumbers] = {
    "layers/attention/q_proj": MuonDimensionNumbers((-3,), (-2, -1)),          # [L, D, N, H]
    "layers/attention/k_proj": MuonDimensionNumbers((-3,), (-2, -1)),          # [L, D, K, H]
    "layers/attention/v_proj_current": MuonDimensionNumbers((-3,), (-2, -1)),  # [L, D, K/2, H]
    "layers/attention/v_proj_delayed": MuonDimensionNumbers((-3,), (-2, -1)),  # [L, D, K/2, H]
    "layers/attention/o_proj": MuonDimensionNumbers((-3, -2), (-1,)),          # [L, N, H, D]
    "layers/moe/gate": MuonDimensionNumbers((-2,), (-1,)),                     # [L, E, D, I]
    "layers/moe/up": MuonDimensionNumbers((-2,), (-1,)),                       # [L, E, D, I]
    "layers/moe/down": MuonDimensionNumbers((-2,), (-1,)),                     # [L, E, I, D]
    "layers/moe/router/down_proj": MuonDimensionNumbers((-2,), (-1,)),         # [L, D, R]
    "layers/moe/router/fc1": MuonDimensionNumbers((-2,), (-1,)),               # [L, R, R]
    "layers/moe/router/fc2": MuonDimensionNumbers((-2,), (-1,)),               # [L, R, R]
    "layers/moe/router/out_proj": MuonDimensionNumbers((-2,), (-1,)),          # [L, R, E+1]
}
CONV_KERNELS = ("layers/attention/conv_depthwise_weight", "layers/attention/conv_grouped_weight")
EMBEDDING = "embed"


TEXT_PREFIX = "text/"  # a vision-language run's text-model parameters


def path_name(path) -> str:
    """A tree path of dict keys -> 'layers/moe/gate'."""
    return "/".join(str(getattr(k, "key", k)) for k in path)


def text_name(name: str) -> str:
    """A parameter's name in the text model ('text/layers/moe/gate' -> 'layers/moe/gate')."""
    return name.removeprefix(TEXT_PREFIX)


def text_weight(name: str) -> bool:
    """A vision-language run's text-model parameters but the vision LoRA (what train.freeze_text freezes)."""
    return name.startswith(TEXT_PREFIX) and "/vision_lora/" not in name


def vision_kernel(name: str) -> bool:
    """The tower's and the vision LoRA's matrices (decayed; the tower's biases and norms are not)."""
    leaf = name.rsplit("/", 1)[-1]
    return (name.startswith("vision/") and leaf.endswith("kernel")) or ("/vision_lora/" in name)


def _map_params(fn: Callable[[str], object], tree):
    """fn(path name) for every leaf of a (possibly partition-masked) parameter tree."""
    return jax.tree_util.tree_map_with_path(lambda path, _: fn(path_name(path)), tree)


def param_labels(params, settings: OptimizerSettings, frozen: Callable[[str], bool] | None = None):
    """'muon', 'adamw' or (where `frozen` holds) 'frozen' per parameter."""
    def label(name: str) -> str:
        if frozen is not None and frozen(name):
            return "frozen"
        return "muon" if settings.name == "muon" and text_name(name) in MUON_MATRICES else "adamw"
    return _map_params(label, params)


def decay_mask(params, settings: OptimizerSettings):
    """True where weight decay applies."""
    decayed = set(MUON_MATRICES) | set(CONV_KERNELS) | ({EMBEDDING} if settings.decay_embedding else set())
    return _map_params(lambda name: text_name(name) in decayed or vision_kernel(name), params)


def schedule(settings: OptimizerSettings, total_steps: int, peak: float) -> optax.Schedule:
    """Learning rate at each applied update.

    cosine: linear warmup to `peak`, cosine decay to peak * min_lr_ratio at total_steps.
    wsd: linear warmup, constant, then a linear decay to peak * min_lr_ratio over the last
         decay_fraction of the steps (warmup-stable-decay).
    constant: linear warmup, then `peak`.
    """
    s = settings
    end = peak * s.min_lr_ratio
    if s.schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(0.0, peak, s.warmup_steps, total_steps, end)
    warmup = optax.linear_schedule(0.0, peak, s.warmup_steps)
    if s.schedule == "constant":
        return optax.join_schedules([warmup, optax.constant_schedule(peak)], [s.warmup_steps])
    decay_start = max(s.warmup_steps, int(total_steps * (1 - s.decay_fraction)))
    return optax.join_schedules(
        [warmup, optax.constant_schedule(peak), optax.linear_schedule(peak, end, total_steps - decay_start)],
        [s.warmup_steps, decay_start])


MATRIX = MuonDimensionNumbers((-2,), (-1,))  # a [B, m, n] stack of m x n matrices


def _layout(name: str, ndim: int) -> tuple[tuple[int, ...], int, int]:
    """(axis order batch + reduction + output, #batch axes, #reduction axes) of parameter `name`."""
    spec = MUON_MATRICES[text_name(name)]
    reduction = tuple(a % ndim for a in spec.reduction_axis)
    output = tuple(a % ndim for a in spec.output_axis)
    batch = tuple(a for a in range(ndim) if a not in reduction + output)
    return batch + reduction + output, len(batch), len(reduction)


def replica_group() -> tuple[str, ...]:
    """The current mesh's data-parallel group, the axes every replica of a weight spans
    (rules.zero1_axes: data, context; () without a mesh or with both of size 1)."""
    mesh = jax.sharding.get_abstract_mesh()
    return () if mesh.empty else zero1_axes(mesh)


def as_matrices(name: str, x: jax.Array, group: tuple[str, ...] = ()) -> jax.Array:
    """Parameter-shaped `x` -> [B, m, n]: batch axes (layers, experts) flattened, then the reduction
    and output axes (the order optax's Muon reshapes to).

    With a group of R ranks (replica_group) the stack is zero-padded to a multiple of R matrices
    and sharded over the group (m and n left to the partitioner), so that every rank holds
    ceil(B / R) whole matrices. (An uneven sharding instead left XLA:CPU's collectives waiting for
    devices that held no matrix.) Newton-Schulz maps a zero matrix to zero.

    The rows move to their ranks while the batch axes are flattened and the matrix axes still
    separate ([B, *reduction axes, *output axes]): the partitioner moves a ZeRO-1 slice of a matrix
    axis there with one all-to-all. Merged into m and n first, a sharded matrix axis made it gather
    the whole stack to every rank ("involuntary full rematerialization")."""
    order, batch, reduction = _layout(name, x.ndim)
    y = x.transpose(order)
    y = y.reshape(math.prod(y.shape[:batch]), *y.shape[batch:])
    if group:
        ranks = math.prod(jax.sharding.get_abstract_mesh().shape[a] for a in group)
        y = jnp.pad(y, ((0, -y.shape[0] % ranks),) + ((0, 0),) * (y.ndim - 1))
        y = jax.lax.with_sharding_constraint(
            y, P(group if len(group) > 1 else group[0], *([P.UNCONSTRAINED] * (y.ndim - 1))))
    return y.reshape(y.shape[0], math.prod(y.shape[1:1 + reduction]), math.prod(y.shape[1 + reduction:]))


def from_matrices(name: str, y: jax.Array, like: jax.Array, group: tuple[str, ...] = ()) -> jax.Array:
    """as_matrices' inverse: [B', m, n] (B' >= B, any padding dropped) -> the shape of `like`.

    With a group the matrix axes are split apart first and the stack moved back to the ranks
    while the padding is still there: onto the matrix axis ZeRO-1 slices (rules.with_zero1_axes of a
    parameter no other axis shards) with one all-to-all, so that dropping the padding and restoring
    the batch axes stay local. (Dropping it from the stack still spread over the group made the
    partitioner gather the stack to every rank.)"""
    order, batch, _ = _layout(name, like.ndim)
    shape = tuple(like.shape[a] for a in order)
    y = y.reshape(y.shape[0], *shape[batch:])
    if group:
        mesh = jax.sharding.get_abstract_mesh()
        zero1 = list(with_zero1_axes(P(), like.shape, mesh))
        sliced = [order.index(d) for d, entry in enumerate(zero1) if entry is not None]
        if sliced and sliced[0] >= batch:
            spec = [P.UNCONSTRAINED] * y.ndim
            spec[0], spec[1 + sliced[0] - batch] = None, zero1[order[sliced[0]]]
            y = jax.lax.with_sharding_constraint(y, P(*spec))
    y = y[:math.prod(shape[:batch])]
    return y.reshape(shape).transpose(tuple(int(i) for i in np.argsort(order)))


def _on_matrices(fn, tree, like=None):
    """fn(name, leaf[, like leaf]) over a (masked) tree of Muon parameters."""
    if like is None:
        return jax.tree_util.tree_map_with_path(lambda path, x: fn(path_name(path), x), tree)
    return jax.tree_util.tree_map_with_path(lambda path, x, y: fn(path_name(path), x, y), tree, like)


def distributed_muon(settings: OptimizerSettings) -> optax.GradientTransformation:
    """optax's scale_by_muon on every parameter's [B, m, n] stack, spread over the data-parallel ranks
    (as_matrices with replica_group: data x context); its momentum is kept in the parameters'
    shapes (their shardings, ZeRO-1)."""
    s = settings
    muon = scale_by_muon(ns_steps=s.muon_ns_steps, beta=s.muon_momentum, eps=s.eps, nesterov=s.muon_nesterov,
                         weight_dimension_numbers=lambda updates: _map_params(lambda _: MATRIX, updates))

    def init(params):
        state = muon.init(_on_matrices(as_matrices, params))
        return state._replace(mu=_on_matrices(from_matrices, state.mu, params))

    def update(updates, state, params=None):
        del params
        group = replica_group() if s.muon_distributed else ()
        spread = lambda name, x: as_matrices(name, x, group)  # noqa: E731
        out, state = muon.update(_on_matrices(spread, updates), state._replace(mu=_on_matrices(spread, state.mu)))
        back = lambda name, y, like: from_matrices(name, y, like, group)  # noqa: E731
        return _on_matrices(back, out, updates), state._replace(mu=_on_matrices(back, state.mu, updates))
    return optax.GradientTransformation(init, update)


def _muon(settings: OptimizerSettings, lr: optax.Schedule) -> optax.GradientTransformation:
    s = settings

    def rms_match(updates, state, params=None):
        del params

        def scale(name, u):
            spec = MUON_MATRICES[text_name(name)]
            fan_in = 1
            for ax in spec.reduction_axis:
                fan_in *= u.shape[ax]
            fan_out = 1
            for ax in spec.output_axis:
                fan_out *= u.shape[ax]
            return u * (s.muon_rms_scale * max(fan_in, fan_out) ** 0.5)
        return jax.tree_util.tree_map_with_path(lambda p, u: scale(path_name(p), u), updates), state

    return optax.chain(
        distributed_muon(s),
        optax.GradientTransformation(optax.init_empty_state, rms_match),
        optax.add_decayed_weights(s.weight_decay, mask=lambda p: decay_mask(p, s)),
        optax.scale_by_learning_rate(lr),
    )


def make_optimizer(settings: OptimizerSettings, total_steps: int,
                   frozen: Callable[[str], bool] | None = None) -> optax.GradientTransformation:
    """Global-norm clipping, then Muon on MUON_MATRICES and AdamW on the rest (or AdamW on all);
    no update where `frozen` (a parameter path name -> bool) holds."""
    s = settings
    adam_lr = schedule(s, total_steps, s.adam_learning_rate or s.learning_rate)
    adamw = optax.adamw(adam_lr, b1=s.b1, b2=s.b2, eps=s.eps, weight_decay=s.weight_decay,
                        mask=lambda p: decay_mask(p, s))
    transforms = {"adamw": adamw} | ({"frozen": optax.set_to_zero()} if frozen is not None else {})
    if s.name == "muon":
        transforms["muon"] = _muon(s, schedule(s, total_steps, s.learning_rate))
    parts = optax.partition(transforms, lambda p: param_labels(p, s, frozen))
    return optax.chain(optax.clip_by_global_norm(s.grad_clip_norm), parts) if s.grad_clip_norm else parts


def applied_updates(opt_state, without_schedule: jax.Array) -> jax.Array:
    """[] int32: the updates applied so far, as the learning-rate schedule counts them (so the logged
    rate is the applied one, after skipped steps and rollbacks too); `without_schedule` for an
    optimizer that keeps no schedule count (a constant-rate optax transform)."""
    counts = [v for p, v in optax.tree_utils.tree_get_all_with_path(opt_state, "count")
              if "ScaleByScheduleState" in jax.tree_util.keystr(p)]
    return counts[0] if counts else without_schedule
