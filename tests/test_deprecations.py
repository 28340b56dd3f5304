"""Lowering our kernels raises no deprecation from our code, and the libraries' warnings are listed.

A fresh interpreter (so import-time warnings count too, and pytest's filters, which hide jax's and
flax's DeprecationWarnings, do not apply) imports the kernels and lowers, forward and backward:
the flash attention kernel for rocm and the Pallas grouped matmul for cuda (both through
`pallas_kernels.lower_for_gpu`, the GPU lowering of every lowering test), and the native CPU
grouped matmul for cpu. Deprecations (DeprecationWarning, PendingDeprecationWarning, FutureWarning)
whose origin is zaya_jax or pallas_kernels are errors; every other warning is recorded, and the
set left must be exactly the one expected for this jax.
"""

import json
import subprocess
import sys
from pathlib import Path

import jax

from zaya_jax.jax_versions import JAX_VERSION

ROOT = Path(__file__).resolve().parent.parent  # the interpreter imports zaya_jax from here

LOWER = r"""
import json, pathlib, warnings

OURS = r"(zaya_jax|pallas_kernels)(\.|$)"
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for category in (DeprecationWarning, PendingDeprecationWarning, FutureWarning):
        warnings.filterwarnings("error", category=category, module=OURS)
    import jax
    import jax.numpy as jnp
    from pallas_kernels import cca_flash_attention, grouped_matmul, lower_for_gpu
    from zaya_jax.native import grouped_matmul as native

    bf16 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    attention = lambda q, k, v: cca_flash_attention(q, k, v, interpret=False).astype(jnp.float32).sum()
    lower_for_gpu("rocm", jax.jit(jax.value_and_grad(attention, argnums=(0, 1, 2))),
                  bf16(1, 128, 8, 128), bf16(1, 128, 2, 128), bf16(1, 128, 2, 128))
    gmm = lambda lhs, rhs, sizes: grouped_matmul(lhs, rhs, sizes, interpret=False).astype(jnp.float32).sum()
    sizes = jax.ShapeDtypeStruct((4,), jnp.int32)
    lower_for_gpu("cuda", jax.jit(jax.value_and_grad(gmm, argnums=(0, 1))), bf16(256, 128), bf16(4, 128, 128), sizes)
    assert native.available(), native._load_error()
    cpu_gmm = lambda lhs, rhs, sizes: native.grouped_matmul(lhs, rhs, sizes).sum()
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
    jax.jit(jax.value_and_grad(cpu_gmm, argnums=(0, 1))).trace(f32(64, 32), f32(4, 32, 16), sizes).lower()


def origin(filename):
    parts = pathlib.Path(filename).parts
    return parts[parts.index("site-packages") + 1] if "site-packages" in parts else filename

print(json.dumps(sorted({(w.category.__name__, origin(w.filename), str(w.message).split(". ")[0]) for w in caught})))
"""

# What is left from the libraries, by jax version: jax 0.11 deprecates the Pallas Triton backend
# at every Triton lowering (the kernels issue moves NVIDIA to Mosaic GPU); jax 0.10.2 warns nothing.
TRITON_DEPRECATION = ("DeprecationWarning", "jax",
                      "The Pallas Triton backend is deprecated and will be removed in a future JAX version")
EXPECTED = {TRITON_DEPRECATION} if JAX_VERSION >= (0, 11) else set()


def test_lowering_our_kernels_leaves_only_the_expected_library_warnings():
    out = subprocess.run([sys.executable, "-c", LOWER], capture_output=True, text=True,
                         env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"}, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    left = {tuple(w) for w in json.loads(out.stdout.splitlines()[-1])}
    assert left == EXPECTED, (jax.__version__, left)
