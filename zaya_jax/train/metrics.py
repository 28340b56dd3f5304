"""Derived training metrics: router load statistics, model FLOPs and MFU.

Router statistics come from a step's expert_counts [L, E+1] (skip slot last, summed over the
global batch) and dropped [L]:
  expert_load[l, e]   = counts[l, e] / sum_{e' < E} counts[l, e']    (fractions over real experts)
  router_entropy      = mean_l H(expert_load[l]) / ln E              (1 = perfectly balanced)
  load_min / load_max = min / max over layers and experts of expert_load
  skip_rate           = sum_l counts[l, E] / sum_l sum_e counts[l, e]
  drop_rate           = sum_l dropped[l] / sum_l sum_{e < E} counts[l, e]

Model FLOPs per token (fwd + bwd = 3x fwd), counted from the config:
  6 * (active non-embedding parameters + V*D for the tied output projection)
  + 6 * L * S * N * H for causal attention (QK^T and AV, 2 * S/2 * N * H each, forward)
"""

from __future__ import annotations

import numpy as np

from zaya_jax.config import ModelConfig
from zaya_jax.hardware import profile_for_device_kind
from zaya_jax.model.accounting import model_summary

# GPU peaks come from the hardware profiles (zaya_jax.hardware.PROFILES); on CPU hosts
# the peak is per process, not per fake device: the fp32 matmul peak of the project's 2-core CPU
# machine as XLA reaches it (matmul_peak_gflops in benchmarks/results/train_step_cpu_native.json).
CPU_PEAK_FLOPS = 208e9


def router_metrics(expert_counts: np.ndarray, dropped: np.ndarray) -> dict[str, float]:
    counts = np.asarray(expert_counts, np.float64)
    experts = counts[:, :-1]
    routed = np.maximum(experts.sum(-1, keepdims=True), 1.0)
    load = experts / routed
    with np.errstate(divide="ignore", invalid="ignore"):
        entropy = -np.sum(np.where(load > 0, load * np.log(load), 0.0), axis=-1)
    total = max(counts.sum(), 1.0)
    return {"router_entropy": float(np.mean(entropy) / np.log(experts.shape[-1])),
            "expert_load_min": float(load.min()), "expert_load_max": float(load.max()),
            "skip_rate": float(counts[:, -1].sum() / total),
            "drop_rate": float(np.sum(dropped) / max(experts.sum(), 1.0))}


def expert_load(expert_counts: np.ndarray) -> np.ndarray:
    """[L, E+1] counts -> [L, E+1] fractions of each layer's tokens (skip slot included, last)."""
    counts = np.asarray(expert_counts, np.float64)
    return counts / np.maximum(counts.sum(-1, keepdims=True), 1.0)


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    summary = model_summary(cfg)
    matmul = summary["params_active_non_embedding"] + cfg.vocab_size * cfg.hidden_size
    attention = cfg.num_layers * seq_len * cfg.num_q_heads * cfg.head_dim
    return 6.0 * (matmul + attention)


def peak_flops(device_kind: str, platform: str, num_devices: int, num_processes: int,
               override_per_device: float) -> float | None:
    """Peak FLOP/s of the whole job; None when the device kind is unknown and no override is set."""
    if override_per_device > 0:
        return override_per_device * num_devices
    if platform == "cpu":
        return CPU_PEAK_FLOPS * num_processes
    hw = profile_for_device_kind(device_kind)
    return hw.matmul_tflops * 1e12 * num_devices if hw else None
