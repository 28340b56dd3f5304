"""HF safetensors <-> zaya_jax parameters."""

from zaya_jax.convert.hf_load import load_hf
from zaya_jax.convert.hf_save import save_hf

__all__ = ["load_hf", "save_hf"]
