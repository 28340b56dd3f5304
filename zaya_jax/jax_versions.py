"""What differs between the two jax generations the package supports, in one guarded place.

Python 3.11 runs jax 0.10.2, Python >= 3.12 jax 0.11.x (pyproject.toml). The code keeps to APIs
present in both; what is left here is behaviour of the XLA each one ships that a model of the
compiled program has to know.
"""

from __future__ import annotations

import jax

JAX_VERSION: tuple[int, ...] = tuple(jax.__version_info__)

# `jax.checkpoint(f)` outside a loop: jax emits f's forward, an optimization_barrier and f again
# on the barrier's outputs for the backward (prevent_cse). jax 0.10.2's XLA compiles the two
# forwards into one anyway (one dot left where jax emitted two, measured on CPU for the
# single-chunk loss head); jax 0.11's XLA keeps the recompute the program asks for. Inside a loop
# (lax.map) both keep it.
XLA_KEEPS_UNLOOPED_REMAT: bool = JAX_VERSION >= (0, 11)
