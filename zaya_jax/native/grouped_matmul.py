"""CPU grouped matmul through XLA's FFI: each expert multiplies exactly its own rows with
OpenBLAS sgemm (scipy-openblas32), forward and both backward products.

    grouped_matmul(lhs [T,K], rhs [E,K,N], group_sizes [E] int) -> [T,N]
        the jax.lax.ragged_dot contract: rows [start_e, start_e + n_e) of lhs times rhs[e];
        rows past sum(group_sizes) are 0. float32 or bfloat16 (lhs and rhs of one dtype).
    backward: lhs_grad_e = dout_e @ rhs[e]^T, rhs_grad[e] = lhs_e^T @ dout_e (0 for an empty expert).

The C++ handlers (grouped_matmul.cc) are compiled into `_grouped_matmul_ffi*.so` by the package
install (setup.py). `available()` says whether that library loaded; when it did not (no compiler at
install time), it warns once and callers fall back to XLA.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.machinery
import pathlib
import warnings

import jax
import jax.numpy as jnp

LIBRARY_STEM = "_grouped_matmul_ffi"
_TARGETS = ("zaya_grouped_matmul", "zaya_grouped_matmul_transposed", "zaya_grouped_matmul_rhs_grad")


def _library_path() -> pathlib.Path | None:
    here = pathlib.Path(__file__).parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        if (path := here / f"{LIBRARY_STEM}{suffix}").exists():
            return path
    return None


@functools.cache
def _load_error() -> str | None:
    """Load the library and register its FFI targets once -> None, or why it cannot be used."""
    path = _library_path()
    if path is None:
        return "not built (no C++ compiler at install time; reinstall with g++ present)"
    try:
        import scipy_openblas32
        # our library links libscipy_openblas.so by name: load the installed copy first, globally
        blas = ctypes.CDLL(str(pathlib.Path(scipy_openblas32.get_lib_dir()) / scipy_openblas32.get_library(True)),
                           mode=ctypes.RTLD_GLOBAL)
        lib = ctypes.CDLL(str(path))
    except (ImportError, OSError) as err:
        return f"cannot be loaded ({err})"
    # the kernel threads over XLA's pool itself; OpenBLAS's own threads would oversubscribe the cores
    blas.scipy_openblas_set_num_threads(1)
    for name in _TARGETS:
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, name)), platform="cpu")
    return None


def available() -> bool:
    """True when the native kernel is loaded; otherwise warns once (one line) and returns False."""
    error = _load_error()
    if error is not None:
        _warn_once(error)
    return error is None


@functools.cache
def _warn_once(error: str) -> None:
    warnings.warn(f"zaya_jax native CPU grouped matmul {error}; the MoE uses the XLA `tiles` backend",
                  RuntimeWarning, stacklevel=3)


def _call(target: str, shape: tuple[int, ...], a: jax.Array, b: jax.Array, group_sizes: jax.Array) -> jax.Array:
    if (error := _load_error()) is not None:
        raise RuntimeError(f"the native grouped matmul {error}")
    if a.dtype != b.dtype or a.dtype not in (jnp.float32, jnp.bfloat16):
        raise TypeError(f"grouped_matmul takes float32 or bfloat16 operands of one dtype, got {a.dtype}, {b.dtype}")
    out = jax.ShapeDtypeStruct(shape, a.dtype)
    return jax.ffi.ffi_call(target, out, vmap_method="sequential")(a, b, group_sizes.astype(jnp.int32))


@jax.custom_vjp
def grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """lhs [T,K], rhs [E,K,N], group_sizes [E] -> [T,N] (see module docstring)."""
    return _call("zaya_grouped_matmul", (lhs.shape[0], rhs.shape[2]), lhs, rhs, group_sizes)


def _grouped_matmul_fwd(lhs, rhs, group_sizes):
    return grouped_matmul(lhs, rhs, group_sizes), (lhs, rhs, group_sizes)


def _grouped_matmul_bwd(residuals, dout):
    lhs, rhs, group_sizes = residuals
    lhs_grad = _call("zaya_grouped_matmul_transposed", lhs.shape, dout, rhs, group_sizes)
    rhs_grad = _call("zaya_grouped_matmul_rhs_grad", rhs.shape, lhs, dout, group_sizes)
    return lhs_grad, rhs_grad, None


grouped_matmul.defvjp(_grouped_matmul_fwd, _grouped_matmul_bwd)
