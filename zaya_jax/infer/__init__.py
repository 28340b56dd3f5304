"""Inference: the decode state (cache.py), prefill and one-token decode (decode.py), sampling,
generation (generate.py), weight-only quantization (quantize.py) and loading (loading.py)."""

from zaya_jax.infer.cache import DecodeState, cache_numbers_per_token, state_shapes
from zaya_jax.infer.decode import decode_step, prefill
from zaya_jax.infer.generate import generate
from zaya_jax.infer.loading import load_checkpoint, load_hf
from zaya_jax.checkpoints.quantize import QuantizedArray, param_bytes, quantize_model
from zaya_jax.infer.sampling import Sampler

__all__ = ["DecodeState", "QuantizedArray", "Sampler", "cache_numbers_per_token", "decode_step", "generate",
           "load_checkpoint", "load_hf", "param_bytes", "prefill", "quantize_model", "state_shapes"]
