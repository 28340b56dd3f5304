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
