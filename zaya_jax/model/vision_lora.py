"""ZAYA1-VL's vision LoRA: low-rank adapters that act at image positions only (transformers'
`Zaya1VL*` `vision_lora`), so text positions compute exactly the text model.

Shapes: B, S, D as the text model; N, K query and KV heads, H head dim; r_a, r_m the attention and
expert ranks; E experts, I expert width.

  CCA (per layer):  q0 += m * (x A_q) B_q,  k0 += m * (x A_k) B_k,
                    v_current += m * (x A_vc) B_vc,  delayed += m * (x A_vd) B_vd   (then shifted: the
                    previous token's mask decides the delayed value's adapter), out += m * (o A_o) B_o
  experts:          an image token routed to expert e runs it with gate + A_e B_gate_e,
                    up + A_e B_up_e, down + A_down_e B_down_e
m = the image mask [B, S]. transformers computes x A B beside x W; the experts here run the merged
weights instead, as E more experts that only image tokens are routed to, so that every dispatch
backend and expert parallelism serve them unchanged (the same values in exact arithmetic).
B starts at zero: a refined text model starts out computing the text model everywhere.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from zaya_jax.config import ModelConfig
from zaya_jax.model.moe_dispatch import ExpertWeights
from zaya_jax.model.params import constant, normal, param


def masked_lora(x: jax.Array, a: jax.Array, b: jax.Array, mask: jax.Array) -> jax.Array:
    """x [B,S,...in], a [...in, r], b [r, ...out], mask [B,S] -> [B,S,...out], 0 off the mask."""
    n_in = a.ndim - 1
    low = jnp.tensordot(x, a.astype(x.dtype), axes=(tuple(range(2, 2 + n_in)), tuple(range(n_in))))
    out = jnp.tensordot(low, b.astype(x.dtype), axes=((2,), (0,)))
    return out * mask.reshape(mask.shape + (1,) * (out.ndim - 2)).astype(out.dtype)


class CCAVisionLoRA(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, n, k, h, r = cfg.hidden_size, cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vision_lora_rank_attn
        init = normal(cfg.init_std)
        down = lambda shape, axes: param(init, rngs.params(), shape, axes)  # noqa: E731
        self.q_a, self.q_b = down((d, r), ("embed", None)), constant(0.0, (r, n, h), (None, "q_heads", "head_dim"))
        self.k_a, self.k_b = down((d, r), ("embed", None)), constant(0.0, (r, k, h), (None, "kv_heads", "head_dim"))
        value = (r, k // 2, h), (None, "value_heads", "head_dim")
        self.v_current_a, self.v_current_b = down((d, r), ("embed", None)), constant(0.0, *value)
        self.v_delayed_a, self.v_delayed_b = down((d, r), ("embed", None)), constant(0.0, *value)
        self.o_a, self.o_b = down((n, h, r), ("q_heads", "head_dim", None)), constant(0.0, (r, d), (None, "embed"))


class ExpertVisionLoRA(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        e, d, i, r = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.vision_lora_rank_mlp
        init = normal(cfg.init_std)
        self.gate_up_a = param(init, rngs.params(), (e, d, r), ("experts", "embed", None))
        self.gate_b = constant(0.0, (e, r, i), ("experts", None, "expert_mlp"))
        self.up_b = constant(0.0, (e, r, i), ("experts", None, "expert_mlp"))
        self.down_a = param(init, rngs.params(), (e, i, r), ("experts", "expert_mlp", None))
        self.down_b = constant(0.0, (e, r, d), ("experts", None, "embed"))

    def with_image_experts(self, w: ExpertWeights) -> ExpertWeights:
        """[E,...] text experts -> [2E,...]: the text experts, then each with its adapter merged."""
        dt = w.gate.dtype
        p = lambda v: v[...].astype(dt)  # noqa: E731
        merged = ExpertWeights(w.gate + p(self.gate_up_a) @ p(self.gate_b), w.up + p(self.gate_up_a) @ p(self.up_b),
                               w.down + p(self.down_a) @ p(self.down_b))
        return ExpertWeights(*(jnp.concatenate([t, m]) for t, m in zip(w, merged)))


def image_expert_choice(choice: jax.Array, image_mask: jax.Array, num_experts: int) -> jax.Array:
    """choice [B,S] in [0, E] (E = skip) -> in [0, 2E]: image tokens' real experts move to e + E,
    the skip slot to 2E (with_image_experts' layout)."""
    skip = choice == num_experts
    return jnp.where(skip, 2 * num_experts, choice + num_experts * image_mask.astype(choice.dtype))
