"""The one place that picks an implementation per platform.

The model calls `attention_fn(cfg)` and `moe_dispatch_fn(cfg)`; callers never branch on
the platform. `auto` resolves by `jax.default_backend()`:
  attention     cpu: xla; gpu: xla (the Pallas kernel is opt-in until GPU numbers favour it)
  moe backend   cpu: native (the FFI grouped matmul, zaya_jax.native.grouped_matmul; where it was
                not built, tiles, warned once); gpu: ragged
  moe matmul    cpu: xla ragged_dot; gpu: xla ragged_dot
"""

from __future__ import annotations

import functools
from typing import Callable

import jax

from zaya_jax.config import ModelConfig
from zaya_jax.errors import UserError
from zaya_jax.model import moe_dispatch
from zaya_jax.model.attention_core import xla_attention
from zaya_jax.native import grouped_matmul as native_grouped_matmul


def _cpu_moe_backend() -> str:
    """The native grouped matmul where the install built it (fastest on CPU, benchmarks/moe_layer.py),
    else `tiles` (the fastest XLA-only dropless backend; `available()` warns once)."""
    return "native" if native_grouped_matmul.available() else "tiles"


_AUTO_MOE_BACKEND = {"cpu": _cpu_moe_backend}


def platform() -> str:
    return jax.default_backend()


def resolve_moe_backend(name: str, target_platform: str | None = None) -> str:
    """`auto` -> the backend for `target_platform` (default: this process's platform)."""
    return _AUTO_MOE_BACKEND.get(target_platform or platform(), lambda: "ragged")() if name == "auto" else name


def resolve_kernel(name: str) -> str:
    return "xla" if name == "auto" else name


def attention_fn(cfg: ModelConfig) -> Callable:
    """-> attention(q [B,S,N,H], k [B,S,K,H], v [B,S,K,H], segment_ids [B,S] | None) -> [B,S,N,H]."""
    if resolve_kernel(cfg.attention_kernel) == "pallas":
        from pallas_kernels import cca_flash_attention
        return lambda q, k, v, seg: cca_flash_attention(q, k, v, segment_ids=seg, causal=True)
    return xla_attention


def ragged_matmul_fn(cfg: ModelConfig) -> Callable:
    if resolve_kernel(cfg.moe_matmul_kernel) == "pallas":
        from pallas_kernels import grouped_matmul
        return grouped_matmul
    return jax.lax.ragged_dot


def moe_dispatch_fn(cfg: ModelConfig) -> Callable:
    """-> dispatch(x [T,D], expert [T], ExpertWeights) -> (y [T,D], dropped [])."""
    backend = resolve_moe_backend(cfg.moe_backend)
    if backend == "capacity":
        return functools.partial(moe_dispatch.capacity, capacity_factor=cfg.capacity_factor)
    if backend == "ragged":
        return functools.partial(moe_dispatch.ragged, matmul=ragged_matmul_fn(cfg))
    if backend == "tiles":
        return functools.partial(moe_dispatch.tiles, tile=cfg.moe_tile_size)
    if backend == "native":
        if not native_grouped_matmul.available():
            raise UserError("model.moe_backend='native': the native CPU grouped matmul was not built; reinstall "
                            "the package with a C++ compiler present (pip install -e .) or use moe_backend='auto'")
        return functools.partial(moe_dispatch.ragged, matmul=native_grouped_matmul.grouped_matmul)
    return moe_dispatch.dense
