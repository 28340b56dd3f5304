"""The Qwen2.5-VL vision transformer, as ZAYA1-VL uses it (transformers'
`Qwen2_5_VisionTransformerPretrainedModel`).

Shapes: B examples, P patches per example (zaya_jax.model.vision.layout pads each example's images to P),
F = patch_dim (channels x frames x patch x patch), D width, N heads, H = D / N, I MLP width,
M = m*m patches merged into one text token, O = out_hidden_size (the text model's width).

  x = patches Wp                                         [B,P,D]   (the Conv3d of stride = kernel)
  cos, sin = 2D rotary angles of (height, width)         [B,P,H]   H/4 frequencies per axis
  for each block (stacked, lax.scan):
      groups = image_segments if the block is in fullatt_block_indexes else window_segments
      x = x + Wo attention(RoPE(q), RoPE(k), v | same group, bidirectional)(RMSNorm(x))
      x = x + SwiGLU(RMSNorm(x))                          (biases on every projection)
  tokens = GELU(RMSNorm(x) viewed [B,P/M,M*D] W1 + b1) W2 + b2   [B,P/M,O]

Attention is dense over each example's P patches under the group mask (transformers runs one
variable-length attention per window instead); a padding patch (group 0) reads only padding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from zaya_jax.model.norms import RMSNorm
from zaya_jax.model.params import constant, normal, param
from zaya_jax.model.vision.config import VisionConfig
from zaya_jax.model.vision.layout import PatchLayout
from zaya_jax.model.zaya import REMAT_POLICIES


def rotary_angles(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """positions [..., 2] (height, width) -> cos, sin [..., H] float32.

    Each axis rotates with the H/4 frequencies theta^(-4i/H); the angles are laid out
    [height | width | height | width] for a rotate-half rotation over the whole head."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim // 2, 2, dtype=np.float32) / (head_dim // 2))
    angles = positions[..., :, None].astype(jnp.float32) * inv_freq              # [..., 2, H/4]
    angles = angles.reshape(*positions.shape[:-1], head_dim // 2)
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [B,P,N,H]; cos, sin [B,P,H] -> x rotated (rotate-half, fp32), in x's dtype."""
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos[:, :, None] + rotated * sin[:, :, None]).astype(x.dtype)


def dense(x: jax.Array, kernel: jax.Array, bias: jax.Array | None, dtype) -> jax.Array:
    out = jnp.einsum("...i,io->...o", x.astype(dtype), kernel.astype(dtype), preferred_element_type=jnp.float32)
    return (out if bias is None else out + bias).astype(dtype)


class VisionAttention(nnx.Module):
    def __init__(self, cfg: VisionConfig, *, rngs: nnx.Rngs):
        d, n, h = cfg.hidden_size, cfg.num_heads, cfg.head_dim
        init = normal(d ** -0.5)
        self.qkv_kernel = param(init, rngs.params(), (d, 3, n, h), ("vision_embed", None, "vision_heads", "head_dim"))
        self.qkv_bias = constant(0.0, (3, n, h), (None, "vision_heads", "head_dim"))
        self.out_kernel = param(init, rngs.params(), (n, h, d), ("vision_heads", "head_dim", "vision_embed"))
        self.out_bias = constant(0.0, (d,), ("vision_embed",))

    def __call__(self, x, cos, sin, groups, dtype) -> jax.Array:
        """x [B,P,D], cos/sin [B,P,H], groups [B,P] int -> [B,P,D]."""
        qkv = jnp.einsum("bpd,dtnh->bptnh", x.astype(dtype), self.qkv_kernel[...].astype(dtype),
                         preferred_element_type=jnp.float32) + self.qkv_bias[...]
        q, k, v = (qkv[:, :, i].astype(dtype) for i in range(3))
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        logits = jnp.einsum("bqnh,bknh->bnqk", q, k, preferred_element_type=jnp.float32) * q.shape[-1] ** -0.5
        visible = groups[:, None, :, None] == groups[:, None, None, :]
        weights = jax.nn.softmax(jnp.where(visible, logits, jnp.finfo(jnp.float32).min), axis=-1)
        o = jnp.einsum("bnqk,bknh->bqnh", weights.astype(dtype), v, preferred_element_type=jnp.float32)
        out = jnp.einsum("bqnh,nhd->bqd", o.astype(dtype), self.out_kernel[...].astype(dtype),
                         preferred_element_type=jnp.float32)
        return (out + self.out_bias[...]).astype(dtype)


class VisionMLP(nnx.Module):
    """SwiGLU with biases: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: VisionConfig, *, rngs: nnx.Rngs):
        d, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_kernel = param(normal(d ** -0.5), rngs.params(), (d, i), ("vision_embed", "vision_mlp"))
        self.gate_bias = constant(0.0, (i,), ("vision_mlp",))
        self.up_kernel = param(normal(d ** -0.5), rngs.params(), (d, i), ("vision_embed", "vision_mlp"))
        self.up_bias = constant(0.0, (i,), ("vision_mlp",))
        self.down_kernel = param(normal(i ** -0.5), rngs.params(), (i, d), ("vision_mlp", "vision_embed"))
        self.down_bias = constant(0.0, (d,), ("vision_embed",))

    def __call__(self, x, dtype) -> jax.Array:
        gate = dense(x, self.gate_kernel[...], self.gate_bias[...], dtype)
        up = dense(x, self.up_kernel[...], self.up_bias[...], dtype)
        return dense(jax.nn.silu(gate) * up, self.down_kernel[...], self.down_bias[...], dtype)


class VisionBlock(nnx.Module):
    def __init__(self, cfg: VisionConfig, *, rngs: nnx.Rngs):
        self.norm1 = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, "vision_embed")
        self.attention = VisionAttention(cfg, rngs=rngs)
        self.norm2 = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, "vision_embed")
        self.mlp = VisionMLP(cfg, rngs=rngs)

    def __call__(self, x, cos, sin, groups, dtype) -> jax.Array:
        x = x + self.attention(self.norm1(x, dtype), cos, sin, groups, dtype)
        return x + self.mlp(self.norm2(x, dtype), dtype)


class PatchMerger(nnx.Module):
    """RMSNorm, then each M consecutive patches' features [M*D] -> GELU MLP -> one token [O]."""

    def __init__(self, cfg: VisionConfig, *, rngs: nnx.Rngs):
        d, wide, o = cfg.hidden_size, cfg.hidden_size * cfg.merge_unit, cfg.out_hidden_size
        self.norm = RMSNorm(d, cfg.rms_norm_eps, "vision_embed")
        self.fc1_kernel = param(normal(wide ** -0.5), rngs.params(), (wide, wide), (None, "vision_mlp"))
        self.fc1_bias = constant(0.0, (wide,), ("vision_mlp",))
        self.fc2_kernel = param(normal(wide ** -0.5), rngs.params(), (wide, o), ("vision_mlp", "embed"))
        self.fc2_bias = constant(0.0, (o,), ("embed",))
        self.merge_unit = cfg.merge_unit

    def __call__(self, x, dtype) -> jax.Array:
        b, p, d = x.shape
        merged = self.norm(x, dtype).reshape(b, p // self.merge_unit, self.merge_unit * d)
        hidden = jax.nn.gelu(dense(merged, self.fc1_kernel[...], self.fc1_bias[...], dtype), approximate=False)
        return dense(hidden, self.fc2_kernel[...], self.fc2_bias[...], dtype)


class VisionTower(nnx.Module):
    """`tower(patches, layout)` -> image tokens [B, P/M, O] in the compute dtype (see the module doc)."""

    def __init__(self, cfg: VisionConfig, *, remat: str = "none", rngs: nnx.Rngs):
        self.config = cfg
        self.remat = remat
        self.patch_kernel = param(normal(cfg.patch_dim ** -0.5), rngs.params(), (cfg.patch_dim, cfg.hidden_size),
                                  ("patch", "vision_embed"))

        @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make_blocks(block_rngs):
            return VisionBlock(cfg, rngs=block_rngs)

        self.blocks = make_blocks(rngs.split(cfg.depth))
        self.merger = PatchMerger(cfg, rngs=rngs)

    def __call__(self, patches: jax.Array, positions: jax.Array, image_segments: jax.Array,
                 window_segments: jax.Array) -> jax.Array:
        """patches [B,P,F]; positions [B,P,2]; image_segments, window_segments [B,P] (a PatchLayout's,
        batched) -> [B, P/M, O]."""
        cfg = self.config
        dtype = jnp.dtype(cfg.dtype)
        if patches.shape[1] % cfg.merge_unit:
            raise ValueError(f"{patches.shape[1]} patches per example are not whole merge units of {cfg.merge_unit}")
        x = dense(patches, self.patch_kernel[...], None, dtype)
        cos, sin = rotary_angles(positions, cfg.head_dim, cfg.rope_theta)
        full = np.isin(np.arange(cfg.depth), cfg.fullatt_block_indexes)
        graphdef, block_states = nnx.split(self.blocks)

        def body(x, xs):
            block_state, is_full = xs
            groups = jnp.where(is_full, image_segments, window_segments)
            return nnx.merge(graphdef, block_state)(x, cos, sin, groups, dtype), None

        if self.remat != "none":
            body = jax.checkpoint(body, policy=REMAT_POLICIES[self.remat])
        x, _ = jax.lax.scan(body, x, (block_states, jnp.asarray(full)))
        return self.merger(x, dtype)

    def embed_images(self, patches: jax.Array, layout: PatchLayout) -> jax.Array:
        """One example's patches [P,F] with its (unbatched) layout -> tokens [P/M, O]."""
        batched = [jnp.asarray(a)[None] for a in (layout.positions, layout.image_segments, layout.window_segments)]
        return self(jnp.asarray(patches)[None], *batched)[0]
