"""A model split into its graph, parameter and balancing-bias states: how a checkpoint's arrays
turn back into a ZayaLM (or a ZayaVL: a vision-language run's params are {text: ZayaLM's,
vision: the tower's}).

L layers, E experts (+1 skip slot). `params` is the model's nnx.Param state as a nested dict
(nnx.to_pure_dict); the balancing biases [L, E+1] are not parameters (no gradient) and live apart.
"""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import Mesh, PartitionSpec as P

from zaya_jax.model.params import BalancingBias
from zaya_jax.model.zaya import ZayaLM
from zaya_jax.parallel.rules import state_shardings
from zaya_jax.data.vision.image_rows import IMAGE_KEYS
from zaya_jax.model.vision.vl import ZayaVL, is_vision_language

BIASES_PATH = ("layers", "moe", "router", "balancing_biases")
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
