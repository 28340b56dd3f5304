"""Test bootstrap: 8 fake CPU devices, absl flags parsed (Grain workers), a compilation cache; tests
marked `torch_reference` (they compare with PyTorch transformers) skipped, so counted, where
torch or transformers is not installed (the Python 3.12 run: the registry's torch there is a
multi-GB CUDA build). Everywhere else they run, and a missing torch fails them."""

import importlib.util
import os
import tempfile

from fake_devices import FAKE_DEVICES

os.environ.setdefault("XLA_FLAGS", FAKE_DEVICES)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from absl import flags  # noqa: E402

if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_compilation_cache_dir",
                  os.environ.get("ZAYA_JAX_TEST_CACHE", os.path.join(tempfile.gettempdir(), "zaya_jax_jit_cache")))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


HAS_TORCH_REFERENCE = all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers"))
WITHOUT_TORCH = pytest.mark.skip(reason="left out: compares with PyTorch transformers, and torch or transformers "
                                        "is not installed")


def pytest_configure(config):
    config.addinivalue_line("markers", "torch_reference: compares with PyTorch transformers (needs torch)")


def pytest_collection_modifyitems(config, items):
    """Without torch, the torch_reference tests are skipped (pytest's closing line counts them)."""
    if not HAS_TORCH_REFERENCE:
        for item in items:
            if item.get_closest_marker("torch_reference"):
                item.add_marker(WITHOUT_TORCH)
