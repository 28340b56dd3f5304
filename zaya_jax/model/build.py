"""Building a ZayaLM without paying for eager, op-by-op initialisation."""

from __future__ import annotations

import jax
from flax import nnx

from zaya_jax.config import ModelConfig
from zaya_jax.model.zaya import ZayaLM


def abstract_model(cfg: ModelConfig, seed: int = 0) -> ZayaLM:
    """A ZayaLM whose arrays are jax.ShapeDtypeStructs: no memory, no compute."""
    return nnx.eval_shape(lambda: ZayaLM(cfg, rngs=nnx.Rngs(seed)))


def create_model(cfg: ModelConfig, seed: int = 0) -> ZayaLM:
    """A randomly initialised ZayaLM, initialised in one jitted program."""
    graphdef, _ = nnx.split(abstract_model(cfg, seed))
    state = jax.jit(lambda: nnx.split(ZayaLM(cfg, rngs=nnx.Rngs(seed)))[1])()
    return nnx.merge(graphdef, state)
