"""Pure model maths: norms, rope, CCA, router, MoE, the decoder stack."""

from zaya_jax.model.moe import MoEStats
from zaya_jax.model.zaya import ZayaLM

__all__ = ["MoEStats", "ZayaLM"]
