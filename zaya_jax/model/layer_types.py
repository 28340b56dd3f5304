"""Per-layer attention type: full causal ("hybrid") or sliding-window ("hybrid_sliding") CCA.

transformers' `ZayaConfig.layer_types` names one type per decoder layer. The two differ only in
attention: a sliding layer's query s sees keys s - W < t <= s (W = `sliding_window`, itself
included; transformers' `sliding_window_overlay`), on top of causality and packed documents,
and rotates with its own RoPE base and scaling (`sliding_rope_theta`, `sliding_rope_scaling`:
transformers' `rope_parameters["hybrid_sliding"]`). CCA's convolutions and value shift are the
same in both.

The layers stay stacked under `lax.scan`: each layer's type is a bool scanned beside its
parameters (`layer_flags`), and `LayerKinds.for_layer` picks that layer's RoPE table and
attention from it (`LayerKinds.rope`: the table alone, for decoding). With both types present
the attention is a `lax.cond` between the windowed and the full call, so each keeps a static
window and its block skipping (XLA path and Pallas kernel); a model of one type calls its
attention directly.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from zaya_jax.config import ModelConfig
from zaya_jax.model.rope import rope_cos_sin


def layer_flags(cfg: ModelConfig) -> jax.Array:
    """[L] bool: True where the layer is "hybrid_sliding"."""
    return jnp.asarray(cfg.sliding_layers, bool)


class LayerKinds(NamedTuple):
    """RoPE tables and attention of both layer types for one forward pass."""
    full_rope: tuple[jax.Array, jax.Array]      # cos, sin [B,S,R] at the full layers' base and scaling
    sliding_rope: tuple[jax.Array, jax.Array]   # cos, sin [B,S,R] at sliding_rope_theta and its scaling
    attention: Callable | None                  # attention(q, k, v, segment_ids, window=None)
    window: int
    types: frozenset                            # the flags present: {False}, {True} or both

    def rope(self, sliding: jax.Array) -> tuple[jax.Array, jax.Array]:
        """sliding: [] bool (the layer's flag) -> that layer's cos, sin [B,S,R]."""
        if len(self.types) == 1:
            return self.sliding_rope if True in self.types else self.full_rope
        cos, sin = (jnp.where(sliding, s, f) for s, f in zip(self.sliding_rope, self.full_rope))
        return cos, sin

    def for_layer(self, sliding: jax.Array) -> tuple[jax.Array, jax.Array, Callable]:
        """sliding: [] bool -> cos, sin [B,S,R] and attention(q, k, v, segment_ids) of that layer."""
        windowed = functools.partial(self.attention, window=self.window)
        if len(self.types) == 1:
            return *self.rope(sliding), windowed if True in self.types else self.attention

        def either(q, k, v, segment_ids):
            return jax.lax.cond(sliding, windowed, self.attention, q, k, v, segment_ids)
        return *self.rope(sliding), either


def layer_kinds(cfg: ModelConfig, positions: jax.Array, attention: Callable | None = None,
                rope_theta: float | None = None, seq_len: jax.Array | None = None) -> LayerKinds:
    """positions: [B,S] int; attention: as attention_fn's (None: only `rope` is called).
    rope_theta: the full layers' RoPE base (default cfg.rope_theta; a curriculum phase's
    overrides it, under the same cfg.rope_scaling); sliding layers always rotate with
    cfg.sliding_rope_theta and cfg.sliding_rope_scaling. seq_len: [] int, the sequence length
    that dynamic and longrope scaling read (default max(positions) + 1; zaya_jax.model.rope)."""
    types = frozenset(cfg.sliding_layers)

    def table(theta, scaling):
        return rope_cos_sin(positions, cfg.rotary_dim, theta, scaling, cfg.max_position_embeddings, seq_len)
    full = table(rope_theta or cfg.rope_theta, cfg.rope_scaling) if False in types else None
    sliding = table(cfg.sliding_rope_theta, cfg.sliding_rope_scaling) if True in types else None
    return LayerKinds(full or sliding, sliding or full, attention, cfg.sliding_window, types)
