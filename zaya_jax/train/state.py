"""The train state: a pytree of arrays, its shardings and how it turns back into a ZayaLM (or a
ZayaVL: a vision-language run's params are {text: ZayaLM's, vision: the tower's}).

L layers, E experts (+1 skip slot). `params` is the model's nnx.Param state as a nested dict
(nnx.to_pure_dict); the balancing biases are not parameters (no gradient) and live apart. A DPO
run also carries its reference model: a frozen copy of the starting params and biases (the
biases too, since the balancing controller moves them during training).
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from zaya_jax.data.vision.image_rows import IMAGE_KEYS
from zaya_jax.model.params import BalancingBias
from zaya_jax.model.vision.vl import ZayaVL, is_vision_language
from zaya_jax.model.zaya import ZayaLM
from zaya_jax.parallel.rules import state_shardings, with_zero1_axes

BIASES_PATH = ("layers", "moe", "router", "balancing_biases")


@flax.struct.dataclass
class TrainState:
    step: jax.Array               # [] int32: steps taken (applied or skipped)
    params: dict                  # nested dict of fp32 master parameters
    biases: jax.Array             # [L, E+1] fp32 balancing biases (skip slot last)
    opt_state: optax.OptState     # of `params`
    controller_state: optax.OptState  # the balancing controller's AdamW state, of `biases`
    rng: jax.Array                # [2] uint32 key data, advanced every step: the key of any stochastic
    #                               training feature (ZAYA1 itself has none), so a resume replays it
    skipped_steps: jax.Array      # [] int32: non-finite steps whose update was skipped
    nonfinite_streak: jax.Array   # [] int32: non-finite steps in a row, up to this one
    reference: dict | None = None  # train.objective=dpo: the frozen {params, biases} the run started from
    #                               (sharded like params and biases; checkpointed as the `reference` item)


BATCH_KEYS = ("inputs", "targets", "segment_ids", "positions", "loss_mask")  # each [B, S]


def _biases_path(model: ZayaLM | ZayaVL) -> tuple[str, ...]:
    return ("text", *BIASES_PATH) if is_vision_language(model) else BIASES_PATH


class ModelParts:
    """A ZayaLM (or ZayaVL) split into its graph, parameter and balancing-bias states (abstract templates).

    config: the text model's; image_id: the image placeholder id of a ZayaVL, else None;
    batch_keys: the batch a step takes (BATCH_KEYS, and a ZayaVL's IMAGE_KEYS [B, P, ...])."""

    def __init__(self, model: ZayaLM | ZayaVL):
        self.graphdef, self.params_state, self.biases_state = nnx.split(model, nnx.Param, BalancingBias)
        self.biases_path = _biases_path(model)
        vision = is_vision_language(model)
        self.config = model.text.config if vision else model.config
        self.image_id = model.ids.image if vision else None
        self.batch_keys = BATCH_KEYS + IMAGE_KEYS if vision else BATCH_KEYS

    @staticmethod
    def arrays(model: ZayaLM | ZayaVL) -> tuple[dict, jax.Array]:
        """A concrete model -> (params dict, biases [L, E+1])."""
        _, params, biases = nnx.split(model, nnx.Param, BalancingBias)
        return nnx.to_pure_dict(params), _get(nnx.to_pure_dict(biases), _biases_path(model))

    def merge(self, params: dict, biases: jax.Array) -> ZayaLM | ZayaVL:
        """Arrays (possibly tracers) -> the model using them."""
        p = jax.tree.map(lambda x: x, self.params_state)
        nnx.replace_by_pure_dict(p, params)
        b = jax.tree.map(lambda x: x, self.biases_state)
        nnx.replace_by_pure_dict(b, _nest(self.biases_path, biases))
        return nnx.merge(self.graphdef, p, b)

    def param_specs(self, mesh: Mesh) -> dict:
        return jax.tree.map(lambda s: s.spec, nnx.to_pure_dict(state_shardings(self.params_state, mesh)))

    def biases_spec(self, mesh: Mesh) -> P:
        return _get(nnx.to_pure_dict(state_shardings(self.biases_state, mesh)), self.biases_path).spec


def _get(tree: dict, path: tuple[str, ...]):
    for key in path:
        tree = tree[key]
    return tree


def _nest(path: tuple[str, ...], leaf) -> dict:
    for key in reversed(path):
        leaf = {key: leaf}
    return leaf


def without_vision_lora(tree: dict) -> dict:
    """A text model's params tree (of any leaves) without its vision_lora subtrees: what a text run saves."""
    return {k: without_vision_lora(v) if isinstance(v, dict) else v for k, v in tree.items() if k != "vision_lora"}


def merged(base: dict, update: dict) -> dict:
    """`base` with each leaf `update` holds (at the same path) replaced by update's."""
    return {k: (merged(v, update[k]) if isinstance(v, dict) else update[k]) if k in update else v
            for k, v in base.items()}


def initial_state(params: dict, biases: jax.Array, tx: optax.GradientTransformation,
                  controller: optax.GradientTransformation, seed: int, with_reference: bool = False) -> TrainState:
    """Step 0 from `params` and `biases`; with_reference: they are also copied into the frozen
    reference model (its own buffers: the state is donated to every step)."""
    zero = jnp.zeros((), jnp.int32)
    reference = jax.tree.map(jnp.copy, {"params": params, "biases": biases}) if with_reference else None
    return TrainState(step=zero, params=params, biases=biases, opt_state=tx.init(params),
                      controller_state=controller.init(biases),
                      rng=jax.random.key_data(jax.random.key(seed)), skipped_steps=zero, nonfinite_streak=zero,
                      reference=reference)


def _trailing_dict_keys(path) -> tuple[str, ...]:
    keys = []
    for k in reversed(path):
        if not isinstance(k, jax.tree_util.DictKey):
            break
        keys.append(str(k.key))
    return tuple(reversed(keys))


def state_specs(abstract: TrainState, param_specs: dict, biases_spec: P, mesh: Mesh,
                shard_optimizer_over_data: bool) -> TrainState:
    """PartitionSpecs for every leaf of `abstract` (a TrainState of ShapeDtypeStructs).

    Optimizer-state leaves that mirror a parameter (Adam moments, Muon momentum) take that
    parameter's spec, plus the data axis when shard_optimizer_over_data (ZeRO-1: each data-
    parallel rank keeps a slice of the optimizer state); counters are replicated.
    """
    by_path = {tuple(str(k.key) for k in path): spec
               for path, spec in jax.tree_util.tree_leaves_with_path(param_specs, is_leaf=lambda x: isinstance(x, P))}
    shapes = {tuple(str(k.key) for k in path): leaf.shape
              for path, leaf in jax.tree_util.tree_leaves_with_path(abstract.params)}

    def mirrored(tree, other_spec: P | None):
        def one(path, leaf):
            keys = _trailing_dict_keys(path)
            if keys in by_path and shapes[keys] == leaf.shape:
                spec = by_path[keys]
            elif other_spec is not None and leaf.shape == abstract.biases.shape:
                spec = other_spec
            else:
                return P()
            return with_zero1_axes(spec, leaf.shape, mesh) if shard_optimizer_over_data else spec
        return jax.tree_util.tree_map_with_path(one, tree)

    return TrainState(step=P(), params=param_specs, biases=biases_spec,
                      opt_state=mirrored(abstract.opt_state, None),
                      controller_state=mirrored(abstract.controller_state, biases_spec),
                      rng=P(), skipped_steps=P(), nonfinite_streak=P(),
                      reference=None if abstract.reference is None else {"params": param_specs, "biases": biases_spec})


def to_shardings(specs: Any, mesh: Mesh) -> Any:
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def with_shardings(abstract: Any, shardings: Any) -> Any:
    """ShapeDtypeStructs carrying `shardings` (restore targets)."""
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
