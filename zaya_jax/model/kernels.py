"""The one place that picks an implementation per platform.

The model calls `attention_fn(cfg)` and `moe_dispatch_fn(cfg)`; callers never branch on
the platform. `auto` resolves by the platform the program is built for (`platform()`: this
process's backend, or the one `pallas_kernels.building_for` names while lowering for a GPU):
  attention     cpu: xla; gpu: xla (the Pallas kernel is opt-in until GPU numbers favour it)
  moe backend   cpu: native (the FFI grouped matmul, zaya_jax.native.grouped_matmul; fastest
                dropless backend measured on CPU, benchmarks/kernels/moe_layer.py; where it was not
                built, tiles, warned once);
                gpu: ragged (dropless, each expert multiplies only its own rows)
  moe matmul    cpu: xla ragged_dot;
                gpu (cuda and rocm): the Pallas grouped matmul (gate and up in one call).
                Without process-wide XLA flags
                (--xla_gpu_experimental_use_ragged_dot_fusion on CUDA,
                --xla_gpu_experimental_use_ragged_dot_grouped_gemm on ROCm), XLA expands
                ragged_dot into a masked dense dot over every expert: E times the expert FLOPs and
                [E, T, I] temporaries. The Pallas kernel groups by construction, its Triton
                lowering is checked in CI for both platforms (tests/test_gpu_lowering.py), and its
                block sizes are per platform (pallas_kernels.platform_blocks). ragged_dot with
                the flags stays selectable (model.moe_matmul_kernel=xla) and is timed against it
                by benchmarks/gpu/gpu_selftest.py.
  fp8 recipes  (model.matmul_precision, zaya_jax.model.fp8) the formats the chip computes in;
                the experts run `ragged` with the FP8 ragged_dot on every platform (the Pallas
                kernel and the native CPU matmul have no FP8 path), CCA's projections the FP8
                einsum (`projection_einsum`).
Every Pallas kernel runs per device inside jax.shard_map (attention here via
zaya_jax.parallel.attention_sharding, the grouped matmul inside the MoE dispatch's shard_map).
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp

from pallas_kernels import _backend
from zaya_jax.config import ModelConfig
from zaya_jax.errors import UserError
from zaya_jax.model import fp8, moe_dispatch
from zaya_jax.model.attention_core import xla_attention
from zaya_jax.native import grouped_matmul as native_grouped_matmul
from zaya_jax.parallel.attention_sharding import attention_on_mesh


def _cpu_moe_backend() -> str:
    """The native grouped matmul where the install built it (fastest on CPU, benchmarks/kernels/moe_layer.py),
    else `tiles` (the fastest XLA-only dropless backend; `available()` warns once)."""
    return "native" if native_grouped_matmul.available() else "tiles"


_AUTO_MOE_BACKEND = {"cpu": _cpu_moe_backend, "gpu": lambda: "ragged"}
_AUTO_MOE_MATMUL = {"gpu": "pallas"}


def platform() -> str:
    """"cpu" | "gpu" | "tpu": the platform programs are built for now."""
    target = _backend.target()
    return "gpu" if target in _backend.GPU_TARGETS else target


def resolve_moe_backend(name: str, target_platform: str | None = None) -> str:
    """`auto` -> the backend for `target_platform` (default: `platform()`)."""
    return _AUTO_MOE_BACKEND.get(target_platform or platform(), lambda: "ragged")() if name == "auto" else name


def resolve_attention_kernel(name: str) -> str:
    return "xla" if name == "auto" else name


def resolve_moe_matmul_kernel(name: str, target_platform: str | None = None) -> str:
    return _AUTO_MOE_MATMUL.get(target_platform or platform(), "xla") if name == "auto" else name


def attention_fn(cfg: ModelConfig, bidirectional: jax.Array | None = None) -> Callable:
    """-> attention(q [B,S,N,H], k [B,S,K,H], v [B,S,K,H], segment_ids [B,S] | None, window=None)
    -> [B,S,N,H]; window: keys per query of a sliding-window layer (static), None for full causal.
    bidirectional: [B,S] bool positions that also see each other forwards (ZAYA1-VL's images): the
    XLA path only (the Pallas kernel is causal)."""
    if bidirectional is not None:
        if resolve_attention_kernel(cfg.attention_kernel) == "pallas":
            raise UserError("model.attention_kernel='pallas' cannot attend image tokens both ways; use "
                            "model.attention_kernel='xla' (or 'auto') for a vision-language model")
        return functools.partial(xla_attention, bidirectional=bidirectional)
    if resolve_attention_kernel(cfg.attention_kernel) == "pallas":
        from pallas_kernels import cca_flash_attention

        def pallas_attention(q, k, v, seg, window=None, kv_segment_ids=None, q_offset=None):
            return cca_flash_attention(q, k, v, segment_ids=seg, causal=True, window=window,
                                       kv_segment_ids=kv_segment_ids, q_offset=q_offset)
        return functools.partial(attention_on_mesh, pallas_attention)
    return xla_attention


def projection_einsum(matmul_precision: str) -> Callable:
    """-> einsum(spec, x, w) for CCA's q/k/v/o projections: jnp.einsum, or the FP8 product in the
    formats of `matmul_precision` on the chip built for (a ConfigError where it has none)."""
    fmt = fp8.formats(matmul_precision)
    return jnp.einsum if fmt is None else functools.partial(fp8.einsum, fmt=fmt)


def ragged_matmuls(cfg: ModelConfig) -> dict[str, Callable]:
    """The `ragged` dispatch's grouped matmuls (moe_dispatch.ragged's `matmul` and `matmuls`): the
    FP8 ragged_dot under an FP8 recipe, the Pallas kernel with the gate and up products in one
    call, or ragged_dot, one call each."""
    fmt = fp8.formats(cfg.matmul_precision)
    if fmt is not None:
        return {"matmul": functools.partial(fp8.ragged_dot, fmt=fmt)}
    if resolve_moe_matmul_kernel(cfg.moe_matmul_kernel) == "pallas":
        from pallas_kernels import grouped_matmul, grouped_matmuls
        return {"matmul": grouped_matmul, "matmuls": grouped_matmuls}
    return {"matmul": jax.lax.ragged_dot}


def moe_dispatch_fn(cfg: ModelConfig) -> Callable:
    """-> dispatch(x [T,D], expert [T], ExpertWeights) -> (y [T,D], dropped [])."""
    backend = "ragged" if cfg.matmul_precision != "default" else resolve_moe_backend(cfg.moe_backend)
    if backend == "capacity":
        return functools.partial(moe_dispatch.capacity, capacity_factor=cfg.capacity_factor)
    if backend == "ragged":
        return functools.partial(moe_dispatch.ragged, **ragged_matmuls(cfg))
    if backend == "tiles":
        return functools.partial(moe_dispatch.tiles, tile=cfg.moe_tile_size)
    if backend == "native":
        if not native_grouped_matmul.available():
            raise UserError("model.moe_backend='native': the native CPU grouped matmul was not built; reinstall "
                            "the package with a C++ compiler present (pip install -e .) or use moe_backend='auto'")
        return functools.partial(moe_dispatch.ragged, matmul=native_grouped_matmul.grouped_matmul)
    return moe_dispatch.dense
