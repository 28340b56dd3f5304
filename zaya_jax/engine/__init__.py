"""The serving engine, in process: chunked prefill over a decode state, continuous batching over
fixed slots (engine.py), per-request sampling (step.py, params.py) and exact prefix caching
(prefix_cache.py). It builds on zaya_jax.infer; infer never imports it."""

from zaya_jax.engine.engine import Engine, Finished, TokenEvent
from zaya_jax.engine.params import SamplingParams

__all__ = ["Engine", "Finished", "SamplingParams", "TokenEvent"]
