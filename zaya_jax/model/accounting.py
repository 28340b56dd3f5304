"""Parameter and KV-cache accounting from an abstract model (nothing is allocated)."""

from __future__ import annotations

import numpy as np
from flax import nnx

from zaya_jax.config import ModelConfig
from zaya_jax.model.build import abstract_model

# Module groups for the breakdown, by the first path components that identify them.
_GROUPS = (
    ("embedding (tied)", ("embed",)),
    ("vision LoRA (attention)", ("layers", "attention", "vision_lora")),   # ZAYA1-VL's adapters (ranks > 0)
    ("vision LoRA (experts)", ("layers", "moe", "vision_lora")),
    ("attention (CCA)", ("layers", "attention")),
    ("router", ("layers", "moe", "router")),
    ("experts", ("layers", "moe")),
    ("norms + residual scaling", ()),
)


def _group(path: tuple[str, ...]) -> str:
    for name, prefix in _GROUPS:
        if path[: len(prefix)] == prefix:
            return name
    raise AssertionError("the empty prefix matches every path")


def parameter_breakdown(cfg: ModelConfig) -> dict[str, int]:
    """Trainable parameters per module group (balancing biases are state, not parameters); the
    vision LoRA groups only where the config has them.

    The first MoE block has no EDA scale in ZAYA1; our stacked layout stores one (never used,
    it multiplies a zero router state), so it is not counted.
    """
    params = nnx.state(abstract_model(cfg), nnx.Param)
    counts = {name: 0 for name, _ in _GROUPS}
    for path, leaf in nnx.to_flat_state(params):
        counts[_group(tuple(str(p) for p in path))] += int(np.prod(leaf.shape))
    counts["router"] -= cfg.router_hidden_size
    return {name: n for name, n in counts.items() if n or not name.startswith("vision LoRA")}


def kv_cache_numbers_per_token_per_layer(cfg: ModelConfig) -> int:
    """K and V of the KV heads (CCA caches post-norm, post-RoPE keys): 2 * K * H."""
    return 2 * cfg.num_kv_heads * cfg.head_dim


def model_summary(cfg: ModelConfig, kv_bytes_per_number: int = 2) -> dict:
    """kv_cache_bytes_per_token: what each decoded token adds (the full layers' caches);
    kv_cache_window_bytes: what the sliding layers' ring buffers hold once full (per sequence,
    whatever its length; zaya_jax.infer.cache). Active: top-1, one expert (and one expert's vision
    LoRA, which image tokens run) per token per layer."""
    breakdown = parameter_breakdown(cfg)
    total = sum(breakdown.values())
    embedding = breakdown["embedding (tied)"]
    experts = breakdown["experts"] + breakdown.get("vision LoRA (experts)", 0)
    active_experts = experts // cfg.num_experts
    kv_numbers = kv_cache_numbers_per_token_per_layer(cfg)
    sliding = sum(cfg.sliding_layers)
    return {
        "params_total": total,
        "params_non_embedding": total - embedding,
        "params_active_non_embedding": total - embedding - experts + active_experts,
        "params_active_total": total - experts + active_experts,
        "kv_cache_numbers_per_token_per_layer": kv_numbers,
        "kv_cache_bytes_per_token": (cfg.num_layers - sliding) * kv_numbers * kv_bytes_per_number,
        "kv_cache_window_bytes": sliding * cfg.sliding_window * kv_numbers * kv_bytes_per_number,
        "breakdown": breakdown,
    }
