"""Loading ml_collections config files and turning their sections into validated objects.

A config file defines `get_config()` returning a ConfigDict with sections:
  model    ModelConfig fields (zaya_jax.config)
  kernels  attention, moe_matmul: auto | xla | pallas
  train, optimizer, balancing, checkpoint, eval, mesh, monitor
           the trainer's (validated by zaya_jax.train.settings; docs/training.md)
  data     the data curriculum (zaya_jax.data.curriculum; docs/data.md)
"""

from __future__ import annotations

import importlib.util
import os

import ml_collections

from zaya_jax.config import ModelConfig


def load_config_file(path: str | os.PathLike) -> ml_collections.ConfigDict:
    """Imports `path` and returns its `get_config()`; errors name the file."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: config file not found")
    spec = importlib.util.spec_from_file_location(f"zaya_config_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "get_config"):
        raise ValueError(f"{path}: defines no get_config()")
    return module.get_config()


def model_config(config: ml_collections.ConfigDict) -> ModelConfig:
    """The validated ModelConfig of a full config (model section plus kernel choices)."""
    if "model" not in config:
        raise ValueError("config has no 'model' section")
    values = dict(config.model.items())
    kernels = config.get("kernels", {})
    for field, key in (("attention_kernel", "attention"), ("moe_matmul_kernel", "moe_matmul")):
        if key in kernels:
            values[field] = kernels[key]
    return ModelConfig.from_config(values)
