"""Native CPU kernels called from XLA through `jax.ffi` (built by the package install when a C++
compiler is present; see setup.py)."""
