"""Shared tiny models for tests (one jitted init per config per session)."""

from __future__ import annotations

import functools

from zaya_jax.config import ModelConfig
from zaya_jax.model.build import create_model

TINY = ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=8,
                   num_experts=4, moe_intermediate_size=16, router_hidden_size=8, rope_theta=10_000.0,
                   max_position_embeddings=256, router_norm_eps=1e-6)


@functools.lru_cache(maxsize=None)
def tiny_model(**overrides):
    """A random tiny model; routing made non-trivial by a larger router init."""
    return create_model(TINY.replace(**overrides), seed=0)


@functools.lru_cache(maxsize=None)
def random_tiny_model(seed: int = 0, **overrides):
    """tiny_model with every parameter random, as tests/hf_reference.make_hf_model randomizes an HF
    model (scales and norms around 1, key temperatures in [0.5, 1.5), biases included, the skip
    slot's balancing bias -1), so that greedy text varies from token to token."""
    import jax
    import numpy as np
    from flax import nnx

    graphdef, state = nnx.split(tiny_model(**overrides))
    rng = np.random.default_rng(seed)

    def draw(path, x):
        name = jax.tree_util.keystr(path)
        if "scale" in name or "norm" in name:
            return 1.0 + 0.2 * rng.standard_normal(x.shape, np.float32)
        if "temperature" in name:
            return 0.5 + rng.random(x.shape, np.float32)
        if "balancing_biases" in name:
            return np.concatenate([0.1 * rng.standard_normal(x.shape[:-1] + (x.shape[-1] - 1,), np.float32),
                                   np.full(x.shape[:-1] + (1,), -1.0, np.float32)], axis=-1)
        if name.endswith("_bias'].value") and "conv" not in name:  # the residual stream's offsets: small, or they
            return 0.02 * rng.standard_normal(x.shape, np.float32)     # steer every token to the same logits
        return 0.3 * rng.standard_normal(x.shape, np.float32)
    return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(lambda p, x: np.asarray(draw(p, x), x.dtype), state))
