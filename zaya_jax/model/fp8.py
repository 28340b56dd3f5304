"""FP8 matmuls for training: e4m3 operands forward, e5m2 gradients, per-tensor current scaling.

A recipe (`model.matmul_precision`) names the formats; the chip the program is built for decides
which family exists (MaxText's Qwix recipes `fp8_gpu` / `fp8_nanoo` draw the same line):
  default    matmuls in the compute dtype (model.dtype); nothing here runs
  fp8        the chip's own family: FNUZ on gfx942 (MI300X, MI325X), OCP elsewhere
  fp8_gpu    OCP: float8_e4m3fn forward, float8_e5m2 gradients (H100/H200, MI350 gfx950)
  fp8_nanoo  FNUZ: float8_e4m3fnuz forward, float8_e5m2fnuz gradients (MI300X gfx942 only)
On CPU every family computes (XLA upcasts inside the dot), so the tests run either.

One FP8 product of a and b (an einsum, or ragged_dot for the grouped experts):
  s_a = max|a| / max(e4m3), a_q = e4m3(a / s_a)     (likewise b; the scale is an f32 scalar)
  y   = dot(a_q, b_q, preferred_element_type=f32) * s_a s_b, cast to a's dtype
backward, g the cotangent of y:
  s_g = max|g| / max(e5m2), g_q = e5m2(g / s_g)
  da  = dot(g_q, b_q) s_g s_b,   db = dot(a_q, g_q) s_a s_g   (both FP8 dots, f32 accumulation)
The scales are constants to differentiation (straight-through, as Qwix and Transformer Engine).
Only the expert MLPs and CCA's q/k/v/o projections use it (zaya_jax.model.kernels hands them
the product); the CCA convolutions, router, norms, embedding and LM head stay in model.dtype.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels import _backend
from zaya_jax.config import ConfigError


class Formats(NamedTuple):
    forward: str   # jnp dtype name of activations and weights
    backward: str  # jnp dtype name of the output gradient


OCP = Formats("float8_e4m3fn", "float8_e5m2")
FNUZ = Formats("float8_e4m3fnuz", "float8_e5m2fnuz")
_RECIPE_FORMATS = {"fp8_gpu": OCP, "fp8_nanoo": FNUZ}
FNUZ_ARCHS = ("gfx942",)  # MI300X / MI325X compute FNUZ only; gfx950 (MI350) and NVIDIA OCP only
_FNUZ_KINDS = ("MI300", "MI325")


def chip() -> str:
    """The chip programs are built for now: 'cpu', a CUDA device kind, or a ROCm arch / kind
    ('gfx942' while lowering for rocm from a process without one: pallas_kernels.LOWERING_DEVICES)."""
    target = _backend.target()
    if target not in _backend.GPU_TARGETS:
        return target
    if _backend.live_target() == target:  # this process's own GPU
        device = jax.devices()[0]
        return f"{getattr(device, 'compute_capability', '')} {device.device_kind}".strip()
    return _backend.LOWERING_DEVICES[target].device_kind


def chip_family(name: str) -> Formats | None:
    """The FP8 family a chip computes in: FNUZ on gfx942, OCP on other GPUs, None for cpu (both run)."""
    if name == "cpu":
        return None
    if any(a in name for a in FNUZ_ARCHS) or any(k in name for k in _FNUZ_KINDS):
        return FNUZ
    return OCP


def formats(recipe: str, chip_name: str | None = None) -> Formats | None:
    """The formats `recipe` computes in on `chip_name` (default: `chip()`); None for 'default'.

    Raises a ConfigError naming model.matmul_precision when the chip computes in the other
    family or this jax lacks the dtypes (zaya_jax.config refuses an unknown recipe)."""
    if recipe == "default":
        return None
    chip_name = chip() if chip_name is None else chip_name
    family = chip_family(chip_name)
    chosen = _RECIPE_FORMATS.get(recipe, family or OCP)
    if family is not None and chosen != family:
        other = "fp8_nanoo" if family == FNUZ else "fp8_gpu"
        raise ConfigError(f"model.matmul_precision={recipe!r}: {chip_name} has no {chosen.forward} matmuls; "
                          f"use 'fp8' (the chip's own formats) or {other!r}")
    missing = [name for name in chosen if not hasattr(jnp, name)]
    if missing:
        raise ConfigError(f"model.matmul_precision={recipe!r}: jax {jax.__version__} has no {missing[0]}; "
                          "upgrade jax or set model.matmul_precision='default'")
    return chosen


def quantize(x: jax.Array, dtype: str) -> tuple[jax.Array, jax.Array]:
    """x: any shape -> (x / s in `dtype`, s [] f32) with s = max|x| / max(dtype) (current scaling)."""
    limit = float(jnp.finfo(dtype).max)
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)))
    scale = jnp.maximum(amax, jnp.finfo(jnp.float32).tiny) / limit
    return jnp.clip(x.astype(jnp.float32) / scale, -limit, limit).astype(dtype), scale


class Product(NamedTuple):
    """A bilinear product and its two transposes, each f(p, q, *extra) -> f32."""
    forward: Callable    # (a, b) -> y
    lhs_grad: Callable   # (g, b) -> da
    rhs_grad: Callable   # (a, g) -> db


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _fp8_product(product: Product, fmt: Formats, dtypes: tuple[str, str], a, b, *extra):
    """product(a, b, *extra) in FP8; `dtypes` = (a's, b's): the result's and the gradients' dtypes."""
    return _forward(product, fmt, dtypes, a, b, *extra)[0]


def _forward(product, fmt, dtypes, a, b, *extra):
    a_q, s_a = quantize(a, fmt.forward)
    b_q, s_b = quantize(b, fmt.forward)
    y = (product.forward(a_q, b_q, *extra) * (s_a * s_b)).astype(dtypes[0])
    return y, (a_q, s_a, b_q, s_b, extra)


def _backward(product, fmt, dtypes, residuals, g):
    a_q, s_a, b_q, s_b, extra = residuals
    g_q, s_g = quantize(g, fmt.backward)
    da = (product.lhs_grad(g_q, b_q, *extra) * (s_g * s_b)).astype(dtypes[0])
    db = (product.rhs_grad(a_q, g_q, *extra) * (s_a * s_g)).astype(dtypes[1])
    return (da, db) + tuple(None for _ in extra)


_fp8_product.defvjp(_forward, _backward)


@functools.lru_cache(maxsize=None)
def einsum_product(spec: str) -> Product:
    """`lhs,rhs->out` whose every lhs (rhs) index appears in rhs or out (lhs or out): the projections'."""
    operands, out = spec.replace(" ", "").split("->")
    lhs, rhs = operands.split(",")
    f32 = functools.partial(jnp.einsum, preferred_element_type=jnp.float32)
    return Product(lambda a, b: f32(spec, a, b), lambda g, b: f32(f"{out},{rhs}->{lhs}", g, b),
                   lambda a, g: f32(f"{lhs},{out}->{rhs}", a, g))


def _ragged_rhs_grad(a, g, group_sizes):
    """a [T,K], g [T,N] -> [G,K,N]: each group's rows of a^T g."""
    dims = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(((0,), (0,)), ((), ())),
                                             lhs_ragged_dimensions=[0], rhs_group_dimensions=[])
    return jax.lax.ragged_dot_general(a, g, group_sizes, dims, preferred_element_type=jnp.float32)


RAGGED = Product(lambda a, b, sizes: jax.lax.ragged_dot(a, b, sizes, preferred_element_type=jnp.float32),
                 lambda g, b, sizes: jax.lax.ragged_dot(g, jnp.swapaxes(b, 1, 2), sizes,
                                                        preferred_element_type=jnp.float32),
                 _ragged_rhs_grad)


def einsum(spec: str, x: jax.Array, w: jax.Array, *, fmt: Formats) -> jax.Array:
    """jnp.einsum(spec, x, w) as one FP8 product in `fmt`; the result in x's dtype."""
    return _fp8_product(einsum_product(spec), fmt, (x.dtype.name, w.dtype.name), x, w)


def ragged_dot(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, fmt: Formats) -> jax.Array:
    """jax.lax.ragged_dot(lhs [T,K], rhs [G,K,N], group_sizes [G]) as one FP8 product -> [T,N]."""
    return _fp8_product(RAGGED, fmt, (lhs.dtype.name, rhs.dtype.name), lhs, rhs, group_sizes)
