"""Inference: the decode state (cache.py), prefill and one-token decode (decode.py), sampling,
the static generation loop (static_loop.py), weight-only quantization (quantize.py) and loading
(loading.py). The library's `generate`, which also drives the engine, is zaya_jax.engine.generate."""

from zaya_jax.infer.cache import DecodeState, cache_numbers_per_token, state_shapes
from zaya_jax.infer.decode import decode_step, prefill
from zaya_jax.infer.static_loop import generate_static
from zaya_jax.infer.loading import load_checkpoint, load_hf
from zaya_jax.checkpoints.quantize import QuantizedArray, param_bytes, quantize_model
from zaya_jax.infer.sampling import Sampler

__all__ = ["DecodeState", "QuantizedArray", "Sampler", "cache_numbers_per_token", "decode_step", "generate_static",
           "load_checkpoint", "load_hf", "param_bytes", "prefill", "quantize_model", "state_shapes"]
