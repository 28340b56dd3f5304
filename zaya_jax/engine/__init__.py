"""The serving engine, in process: chunked prefill over a decode state, continuous batching over
fixed slots (engine.py), per-request sampling (step.py, params.py) and exact prefix caching
(prefix_cache.py), and the library's `generate` (batch.py: the static loop, or with slots=N the
engine). It builds on zaya_jax.infer; infer never imports it.

    from zaya_jax.engine import generate
    new = generate(model, [[2, 17, 5], [2, 9]], max_new_tokens=32)   # int32 [2, 32]
"""

from zaya_jax.engine.batch import generate
from zaya_jax.engine.engine import Engine, Finished, TokenEvent
from zaya_jax.engine.params import SamplingParams

__all__ = ["Engine", "Finished", "SamplingParams", "TokenEvent", "generate"]
