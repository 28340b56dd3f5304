"""The one place that knows which Pallas backend the kernels lower to.

The kernels are written in the portable Pallas style of the Triton backend (ref indexing,
`pl.program_id`, `fori_loop`, `jnp.dot` / `lax.dot_general`), which runs on CUDA and ROCm. Since
JAX 0.10 a GPU `pallas_call` without compiler params lowers to Mosaic GPU, so on GPU we must pass
Triton compiler params explicitly. On CPU only interpret mode exists; it is chosen automatically.
The Triton backend is deprecated upstream from JAX 0.11 (it still works there, with a
DeprecationWarning at every Triton lowering: tests/test_deprecations.py); this module imports it
lazily and only on GPU, so CPU runs never load it.

`target()` names the platform the kernels are built for: "cuda" or "rocm" on a GPU, "cpu"
otherwise. `building_for(platform)` overrides it while tracing; `lower_for_gpu(platform, ...)`
builds and lowers a jitted function for a GPU platform from a process without one (the tests that
check the GPU lowering on CPU all go through it).
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator

import jax

GPU_TARGETS = ("cuda", "rocm")
# The GPU each platform is lowered for by `lower_for_gpu`, as jax describes a real one
# (jax.Device.device_kind; num_cores its core_count: SMs, CUs). jax 0.11's Pallas Triton lowering
# reads the architecture from this kind (H200: compute capability 9.0; a `gfx` kind is AMD's arch
# name). MI300X reports the marketing kind "AMD Instinct MI300X" and its arch as compute_capability;
# jax accepts the arch name as an abstract kind.
LOWERING_DEVICES = {
    "cuda": jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda"),
    "rocm": jax.sharding.AbstractDevice(device_kind="gfx942", num_cores=304, platform="rocm"),
}
_BUILDING_FOR: contextvars.ContextVar[str | None] = contextvars.ContextVar("building_for", default=None)


@contextlib.contextmanager
def building_for(platform: str) -> Iterator[None]:
    """Trace kernels (and `auto` choices) for `platform` ("cuda", "rocm" or "cpu") in this block.

    jax's trace caches do not know about this choice, so they are cleared on entry and exit:
    nothing traced for one platform is reused for another."""
    if platform not in GPU_TARGETS + ("cpu",):
        raise ValueError(f"building_for: platform must be one of {GPU_TARGETS + ('cpu',)}, got {platform!r}")
    jax.clear_caches()
    token = _BUILDING_FOR.set(platform)
    try:
        yield
    finally:
        _BUILDING_FOR.reset(token)
        jax.clear_caches()


def lower_for_gpu(platform: str, jitted: Any, *args: Any, mesh: jax.sharding.Mesh | None = None,
                  **kwargs: Any) -> jax.stages.Lowered:
    """`jitted.trace(*args, **kwargs).lower(...)` for GPU `platform` ("cuda" | "rocm"), from any process.

    The kernels are built for `platform` (`building_for`) and traced under `mesh` (if given) with
    an abstract device of the platform's real kind (`LOWERING_DEVICES`), entered after
    `jax.set_mesh`, so the Pallas Triton lowering makes the architecture choices the device would.
    jax 0.11 needs that device to lower without a GPU; jax 0.10.2 ignores it and lowers every
    platform for compute capability 9.0, the rocm kernels included.
    """
    if platform not in GPU_TARGETS:
        raise ValueError(f"lower_for_gpu: platform must be one of {GPU_TARGETS}, got {platform!r}")
    with building_for(platform), jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        device_mesh = jax.sharding.get_abstract_mesh().update(abstract_device=LOWERING_DEVICES[platform])
        with jax.sharding.use_abstract_mesh(device_mesh):
            return jitted.trace(*args, **kwargs).lower(lowering_platforms=(platform,))


def target() -> str:
    """"cuda" | "rocm" | "cpu" (or another jax backend name): what kernels are built for now."""
    override = _BUILDING_FOR.get()
    return live_target() if override is None else override


def live_target() -> str:
    """`target()` without `building_for`: this process's own backend, a GPU named by its vendor."""
    backend = jax.default_backend()
    if backend != "gpu":
        return backend
    version = getattr(jax.devices()[0].client, "platform_version", "").lower()
    return "rocm" if "rocm" in version or "hip" in version else "cuda"


def resolve_interpret(interpret: bool | None) -> bool:
    """None means: interpret on CPU, compile elsewhere. An explicit bool is obeyed."""
    if interpret is None:
        return target() not in GPU_TARGETS
    return bool(interpret)


def pallas_call_options(interpret: bool, *, num_warps: int, num_stages: int) -> dict[str, Any]:
    """Keyword arguments for `pl.pallas_call`: interpret mode, or Triton params on GPU."""
    if interpret:
        return {"interpret": True}
    if target() not in GPU_TARGETS:
        raise NotImplementedError(
            f"pallas_kernels lower with the Pallas Triton backend (GPU) or run in interpret mode; "
            f"platform {target()!r} has neither. Use interpret=True or the XLA path.")
    from jax.experimental.pallas import triton as pltriton
    return {"compiler_params": pltriton.CompilerParams(num_warps=num_warps,
                                                       num_stages=num_stages)}


def block_size(requested: int, extent: int, *, minimum: int = 16) -> int:
    """`requested` (a power of two), shrunk to the power of two that covers `extent`.

    It is not shrunk below `minimum`: Triton dots need every dim >= 16. A smaller `requested`
    (tests in interpret mode) is kept as is.
    """
    if requested < 1 or requested & (requested - 1):
        raise ValueError(f"block size must be a power of two, got {requested}")
    return min(requested, max(minimum, 1 << max(extent - 1, 0).bit_length()))


def round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple
