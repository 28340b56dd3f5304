"""Test bootstrap: 8 fake CPU devices, absl flags parsed (Grain workers), a compilation cache."""

import os
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from absl import flags  # noqa: E402

if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()

import jax  # noqa: E402

jax.config.update("jax_compilation_cache_dir",
                  os.environ.get("ZAYA_JAX_TEST_CACHE", os.path.join(tempfile.gettempdir(), "zaya_jax_jit_cache")))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
