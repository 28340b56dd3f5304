"""GRPO's loss on sampled completions (group-relative policy optimisation, as TRL's GRPOTrainer
computes it), from per-token log-probabilities: pure functions for the GRPO objective.

N completions, G per prompt (N = prompts * G, a prompt's completions consecutive), T completion
tokens (padded; `mask` [N, T] is 1 on a completion's real tokens). The train step passes whole
rows instead ([N, S] log-probs and mask, the mask 1 on the completion's targets only, the
advantages repeated along each row [N, S]) with `completion_budget` = T, which sums the same.

  advantages   A_i = r_i - mean of its group's rewards, divided by the std (Bessel-corrected, as
               torch.std) of its group's rewards + 1e-4 (scale_rewards="group", TRL's default), of
               the whole batch's ("batch"), or not at all ("none", Dr. GRPO)
  ratio        rho = exp(logp - old_logp), old_logp from the weights that sampled (with one
               optimisation step per generation batch they are the current weights: rho = 1 and
               the gradient is the policy gradient -A * d logp)
  per token    l = -min(rho A, clip(rho, 1 - epsilon_low, 1 + epsilon_high) A)
                   + beta * (exp(ref - logp) - (ref - logp) - 1)   (the k3 KL estimate to the frozen
                   reference; beta = 0 by default, as TRL's)
  loss_type    grpo     each completion's token mean, then the mean over completions
               dapo     the sum over every completion token / their number (TRL's default)
               dr_grpo  the sum / (N * T), T the completion budget (Dr. GRPO; completion_budget, default
                        the mask's width)
Each is value / count of sums over micro-batches (`GRPOLoss.sums`), so accumulated micro-batches
give the loss of the whole batch, as the train step divides once by the global count.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

LOSS_TYPES = ("grpo", "dapo", "dr_grpo")
SCALE_REWARDS = ("group", "batch", "none")


def group_advantages(rewards: jax.Array, group_size: int, scale_rewards: str = "group"
                     ) -> tuple[jax.Array, jax.Array]:
    """rewards [N] (N = prompts * group_size, groups consecutive) -> (advantages [N], the share of
    groups whose rewards are all equal (their advantages are 0: nothing to learn from))."""
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards must be one of {SCALE_REWARDS}, got {scale_rewards!r}")
    groups = rewards.reshape(-1, group_size)
    centred = (groups - groups.mean(axis=1, keepdims=True)).reshape(-1)
    group_std = jnp.std(groups, axis=1, ddof=1)
    if scale_rewards == "group":
        centred = centred / (jnp.repeat(group_std, group_size) + 1e-4)
    elif scale_rewards == "batch":
        centred = centred / (jnp.std(rewards, ddof=1) + 1e-4)
    return centred, jnp.mean(group_std == 0)


@dataclasses.dataclass(frozen=True)
class GRPOLoss:
    loss_type: str = "dapo"
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    beta: float = 0.0
    completion_budget: int = 0  # dr_grpo's T (0: the mask's width)

    def __post_init__(self):
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {self.loss_type!r}")

    def sums(self, logp: jax.Array, old_logp: jax.Array, ref_logp: jax.Array | None, advantages: jax.Array,
             mask: jax.Array) -> dict[str, jax.Array]:
        """logp, old_logp, ref_logp (None when beta = 0), mask [N, T]; advantages [N] (or [N, T], each
        row's repeated) -> sums []:
        value (to differentiate), count (value / count is the loss), tokens, kl (summed over
        tokens), clipped_low, clipped_high (tokens whose ratio is clipped below or above)."""
        mask = mask.astype(jnp.float32)
        old_logp = jax.lax.stop_gradient(old_logp)
        a = advantages if advantages.ndim == 2 else advantages[:, None]
        ratio = jnp.exp(logp - old_logp)
        clipped = jnp.clip(ratio, 1 - self.epsilon_low, 1 + self.epsilon_high)
        per_token = -jnp.minimum(ratio * a, clipped * a)
        kl = jnp.zeros_like(logp)
        if self.beta:
            if ref_logp is None:
                raise ValueError("beta > 0 needs the reference model's log-probs")
            delta = jax.lax.stop_gradient(ref_logp) - logp
            kl = jnp.exp(delta) - delta - 1
            per_token = per_token + self.beta * kl
        tokens = jnp.sum(mask)
        if self.loss_type == "grpo":
            lengths = jnp.sum(mask, axis=1)
            value = jnp.sum(jnp.sum(per_token * mask, axis=1) / jnp.maximum(lengths, 1.0))
            count = jnp.sum(lengths > 0).astype(jnp.float32)
        else:
            value = jnp.sum(per_token * mask)
            budget = self.completion_budget or mask.shape[1]
            count = tokens if self.loss_type == "dapo" else jnp.float32(mask.shape[0] * budget)
        low = (ratio < 1 - self.epsilon_low) & (a < 0)
        high = (ratio > 1 + self.epsilon_high) & (a > 0)
        return {"value": value, "count": count, "tokens": tokens, "kl": jnp.sum(kl * mask),
                "clipped_low": jnp.sum(low * mask), "clipped_high": jnp.sum(high * mask)}

    def loss(self, logp, old_logp, ref_logp, advantages, mask) -> jax.Array:
        """The loss of one batch [] (the sums' value / count)."""
        s = self.sums(logp, old_logp, ref_logp, advantages, mask)
        return s["value"] / jnp.maximum(s["count"], 1.0)
