"""RMSNorm and ZAYA1's residual scaling.

Residual scaling (zaya1-spec 2.3): before each residual add, both the stream and the block
output get a per-channel affine `(x + beta) * alpha` (not `alpha * x + beta`), alpha = 1 and
beta = 0 at init.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from zaya_jax.model.params import constant


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, dtype) -> jax.Array:
    """LlamaRMSNorm: fp32 statistics, cast to `dtype`, then times the weight.

    x: [..., D]; weight: [D]  ->  [..., D] in `dtype`.
    """
    xf = x.astype(jnp.float32)
    normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight.astype(dtype) * normed.astype(dtype)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, axis_name: str):
        self.weight = constant(1.0, (dim,), (axis_name,))
        self.eps = eps

    def __call__(self, x: jax.Array, dtype) -> jax.Array:
        return rms_norm(x, self.weight[...], self.eps, dtype)


class ResidualScaling(nnx.Module):
    """`new_stream = (out + b_out) * s_out + (stream + b_res) * s_res`, all [D]."""

    def __init__(self, dim: int):
        self.hidden_states_scale = constant(1.0, (dim,), ("embed",))
        self.hidden_states_bias = constant(0.0, (dim,), ("embed",))
        self.residual_scale = constant(1.0, (dim,), ("embed",))
        self.residual_bias = constant(0.0, (dim,), ("embed",))

    def __call__(self, out: jax.Array, stream: jax.Array, stream_dtype) -> jax.Array:
        """out, stream: [B, S, D] -> [B, S, D] in `stream_dtype`."""
        out = (out.astype(stream_dtype) + self.hidden_states_bias[...].astype(stream_dtype)) \
            * self.hidden_states_scale[...].astype(stream_dtype)
        stream = (stream.astype(stream_dtype) + self.residual_bias[...].astype(stream_dtype)) \
            * self.residual_scale[...].astype(stream_dtype)
        return out + stream
