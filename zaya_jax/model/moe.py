"""The ZAYA1 MoE block: one router, 16 SwiGLU experts and a skip slot.

  routing = Router(x, prev_state)                        (zaya_jax.model.router)
  y_t = p_t * SwiGLU_{e_t}(x_t)     for a real expert e_t < E
  y_t = p_t * x_t   (layout "base")  or  0  (layout "native")   for the skip slot e_t = E
Experts: gate, up [E,D,I] and down [E,I,D] ('td,edi->tei' then 'tei,eid->td'); how tokens
reach them is the dispatch backend (zaya_jax.model.moe_dispatch), passed in as a function and run
on each device's tokens by zaya_jax.parallel.moe_sharding (expert parallelism uses fixed capacity).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from zaya_jax.config import ModelConfig
from zaya_jax.model.moe_dispatch import ExpertWeights
from zaya_jax.model.params import normal, param
from zaya_jax.model.router import Router
from zaya_jax.model.vision_lora import ExpertVisionLoRA, image_expert_choice
from zaya_jax.parallel.moe_sharding import dispatch_on_mesh


class MoEStats(NamedTuple):
    """Per MoE block, over the real (non-padding) tokens of the batch."""
    expert_counts: jax.Array  # [E+1] int32 tokens routed to each expert, skip slot last
    prob_sum: jax.Array       # [E+1] float32 router probabilities summed over tokens
    dropped: jax.Array        # [] int32 tokens dropped by a capacity backend


class Gathered(NamedTuple):
    """A MoE dispatch for a few tokens (a decode step): each token's expert weights gathered,
    no dispatch backend. rows(weight variable [E,...], expert [B,S], dtype) -> [B,S,...] as dtype
    (zaya_jax.checkpoints.quantize.rows gathers a quantized weight's integers before dequantizing)."""
    rows: Callable


class MoE(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        e, d, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        init = normal(cfg.init_std)
        self.router = Router(cfg, rngs=rngs)
        self.gate = param(init, rngs.params(), (e, d, i), ("experts", "embed", "expert_mlp"))
        self.up = param(init, rngs.params(), (e, d, i), ("experts", "embed", "expert_mlp"))
        self.down = param(init, rngs.params(), (e, i, d), ("experts", "expert_mlp", "embed"))
        self.skip_passes_input = cfg.layout == "base"
        self.capacity_factor = cfg.capacity_factor
        self.expert_parallel = cfg.expert_parallel
        self.vision_lora = ExpertVisionLoRA(cfg, rngs=rngs) if cfg.vision_lora_rank_mlp else None

    def __call__(self, x: jax.Array, prev_state: jax.Array, token_mask: jax.Array, dispatch: Callable,
                 image_mask: jax.Array | None = None, *, skip_masked: bool = False
                 ) -> tuple[jax.Array, jax.Array, MoEStats]:
        """x: [B,S,D] normed; prev_state: [B,S,R]; token_mask: [B,S] bool; image_mask: [B,S] bool where
        the experts' vision LoRA acts, or None -> y [B,S,D], state, stats. skip_masked (inference,
        whose padding outputs nothing reads): tokens outside token_mask go to the skip slot, so no
        expert computes them (a dropless backend's work follows the real tokens; a capacity backend
        keeps its room for them). dispatch: a `Gathered` runs `gathered` (every token, whatever the
        masks; its stats are those of the routing, nothing dropped)."""
        dt = x.dtype
        if isinstance(dispatch, Gathered):
            return self.gathered(x, prev_state, token_mask, dispatch.rows)
        with jax.named_scope("router"):
            routing = self.router(x, prev_state)
        num_experts = self.gate.shape[0]
        weights = ExpertWeights(self.gate[...].astype(dt), self.up[...].astype(dt), self.down[...].astype(dt))
        choice = jnp.where(token_mask, routing.choice, num_experts) if skip_masked else routing.choice
        if self.vision_lora is not None and image_mask is not None:
            weights = self.vision_lora.with_image_experts(weights)
            choice = image_expert_choice(choice, image_mask, num_experts)
        with jax.named_scope("experts"):
            expert_out, dropped = dispatch_on_mesh(dispatch, x, choice, weights,
                                                   capacity_factor=self.capacity_factor,
                                                   expert_parallel=self.expert_parallel)
        if self.skip_passes_input:
            expert_out = jnp.where((routing.choice == num_experts)[..., None], x, expert_out)
        y = expert_out * routing.weight[..., None].astype(dt)
        return y, routing.next_state, routing_stats(routing, token_mask, num_experts, dropped)

    def gathered(self, x: jax.Array, prev_state: jax.Array, token_mask: jax.Array, rows: Callable
                 ) -> tuple[jax.Array, jax.Array, MoEStats]:
        """__call__ for a few tokens: each token's expert weights gathered by `rows` (Gathered's), no
        dispatch; every token runs its expert (token_mask only counts the stats)."""
        dt = x.dtype
        routing = self.router(x, prev_state)
        num_experts = self.gate.shape[0]
        expert = jnp.minimum(routing.choice, num_experts - 1)                             # [B,S]
        gate, up, down = (rows(p, expert, dt) for p in (self.gate, self.up, self.down))   # [B,S,D,I], [B,S,I,D]
        hidden = jax.nn.silu(jnp.einsum("bsd,bsdi->bsi", x, gate)) * jnp.einsum("bsd,bsdi->bsi", x, up)
        out = jnp.einsum("bsi,bsid->bsd", hidden, down)
        skip = (routing.choice == num_experts)[..., None]
        out = jnp.where(skip, x if self.skip_passes_input else jnp.zeros_like(x), out)
        return (out * routing.weight[..., None].astype(dt), routing.next_state,
                routing_stats(routing, token_mask, num_experts, jnp.zeros((), jnp.int32)))


def routing_stats(routing, token_mask: jax.Array, num_experts: int, dropped: jax.Array) -> MoEStats:
    """A MoE block's stats over token_mask's [B,S] tokens (routing: Router's output)."""
    mask = token_mask.astype(jnp.float32)
    return MoEStats(
        expert_counts=jnp.einsum("bse,bs->e", jax.nn.one_hot(routing.choice, num_experts + 1), mask
                                 ).astype(jnp.int32),
        prob_sum=jnp.einsum("bse,bs->e", routing.probs, mask),
        dropped=dropped,
    )
