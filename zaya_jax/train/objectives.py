"""Training objectives (train.objective): what the train step differentiates, as pure functions.

B rows, S seq, P = S // 2 pairs at most per row. Each objective maps one micro-batch's per-token
nll [B,S] (policy; and the frozen reference model's for DPO) to sums over the micro-batch; the
step adds the sums of every micro-batch and divides once by the global batch's count (so M
micro-batches give exactly the loss and gradient of one big batch).

  lm, sft   value = sum(nll * loss_mask); count = masked tokens; loss = value / count.
            The two differ only in their data: an SFT row's loss_mask is 1 on assistant targets.
  dpo       (Rafailov et al. 2023, as TRL's sigmoid loss with label smoothing, cDPO)
            logp[r, k] = sum of -nll * loss_mask over segment k of row r    [B, S+1]
            pair j of a row: chosen = segment 2j-1, rejected = segment 2j; valid when both have
            supervised tokens (loss_mask > 0)
            h = (logp_c - ref_c) - (logp_r - ref_r)
            loss_pair = -(1 - ls) * log_sigmoid(beta * h) - ls * log_sigmoid(-beta * h)
            with dpo.rpo_alpha = a > 0 (RPO, Pang et al. 2024, as TRL's rpo_alpha): loss_pair +=
            a * nll_c, nll_c = -logp_c / (supervised tokens of the chosen completion), which keeps
            the chosen answers likely while DPO separates them from the rejected ones
            value = sum over valid pairs of loss_pair; count = valid pairs
            rewards: chosen beta * (logp_c - ref_c), rejected beta * (logp_r - ref_r); reported as
            means over pairs: chosen_reward, rejected_reward, reward_margin (chosen - rejected)
            and reward_accuracy (fraction with chosen > rejected)
  grpo      (Shao et al. 2024, as TRL's GRPOTrainer; grpo_loss.py) rows are sampled completions
            (train/grpo_batches.py), each with its group-relative advantage [B,S] (repeated along
            the row) and, with grpo.num_iterations > 1, the sampling weights' log-probs old_logp
            [B,S] (with one step per generation they are the current weights': stop_gradient(logp))
            value, sums = GRPOLoss.sums(-nll, old_logp, -reference nll (beta > 0), advantages,
            loss_mask); count: completion tokens (dapo), completions (grpo) or rows * T (dr_grpo)
            reported: loss, kl (k3 per completion token), clip_ratio (tokens whose ratio was clipped)
            Only columns from scored_from = grpo.max_prompt_length - 1 on can hold a completion's
            target (grpo_rollout's layout): the loss head computes logits there alone (TRL's
            logits_to_keep), and the nll of the prompt's columns is 0
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from zaya_jax.train.grpo_loss import GRPOLoss

OBJECTIVES = ("lm", "sft", "dpo", "grpo")
DATA_KIND = {"lm": "text", "sft": "chat", "dpo": "preference"}  # the prepared-source kind each objective reads
#                                                                 (grpo reads prompts: grpo.prompts)


@dataclasses.dataclass(frozen=True)
class TokenObjective:
    """lm / sft: the masked token-mean nll."""
    name: str = "lm"
    needs_reference = False
    extra_batch_keys = ()  # [B,S] arrays a batch carries beyond state.BATCH_KEYS
    scored_from = 0  # the first column whose target the objective can score (the loss head starts there)
    linear_in_nll = True  # value = sum(nll * token_weights): the step fuses the loss head's gradient
    sum_keys = ("nll", "tokens")
    count_key = "tokens"
    metric_keys = ("loss",)

    def token_weights(self, batch: dict) -> jax.Array:
        """[B,S]: the value is sum(nll * token_weights)."""
        return batch["loss_mask"]

    def weighted_sums(self, value: jax.Array, batch: dict) -> tuple[jax.Array, dict]:
        """value = sum(nll * token_weights) [] -> (value to differentiate [], {nll, tokens} sums [])."""
        return value, {"nll": value, "tokens": jnp.sum(batch["loss_mask"])}

    def micro_sums(self, nll: jax.Array, reference_nll, batch: dict) -> tuple[jax.Array, dict]:
        """nll [B,S] -> (value to differentiate [], {nll, tokens} sums [])."""
        return self.weighted_sums(jnp.sum(nll * self.token_weights(batch)), batch)

    def metrics(self, sums: dict) -> dict:
        return {"loss": sums["nll"] / jnp.maximum(sums["tokens"], 1.0)}

    def evaluation(self, sums: dict) -> dict[str, float]:
        """Held-out totals -> {loss, perplexity, tokens}."""
        loss = float(self.metrics(sums)["loss"])
        return {"loss": loss, "perplexity": math.exp(min(loss, 700.0)), "tokens": int(sums["tokens"])}


@dataclasses.dataclass(frozen=True)
class DPOObjective:
    """Direct preference optimisation against a frozen reference model."""
    beta: float = 0.1
    label_smoothing: float = 0.0
    rpo_alpha: float = 0.0
    name: str = "dpo"
    needs_reference = True
    extra_batch_keys = ()
    scored_from = 0
    linear_in_nll = False
    sum_keys = ("loss", "chosen_reward", "rejected_reward", "correct", "pairs")
    count_key = "pairs"
    metric_keys = ("loss", "reward_margin", "reward_accuracy", "chosen_reward", "rejected_reward", "pairs")

    def micro_sums(self, nll: jax.Array, reference_nll: jax.Array, batch: dict) -> tuple[jax.Array, dict]:
        """nll, reference_nll [B,S] -> (sum of pair losses [], sums [] of sum_keys)."""
        policy, supervised = segment_logps(nll, batch)
        reference, _ = segment_logps(reference_nll, batch)
        chosen, rejected = pair_slices(policy)
        ref_chosen, ref_rejected = pair_slices(reference)
        sup_chosen, sup_rejected = pair_slices(supervised)
        valid = ((sup_chosen > 0) & (sup_rejected > 0)).astype(jnp.float32)  # [B, P]
        chosen_reward, rejected_reward = self.beta * (chosen - ref_chosen), self.beta * (rejected - ref_rejected)
        h = chosen_reward - rejected_reward
        losses = (-(1 - self.label_smoothing) * jax.nn.log_sigmoid(h)
                  - self.label_smoothing * jax.nn.log_sigmoid(-h))
        if self.rpo_alpha:
            losses = losses - self.rpo_alpha * chosen / jnp.maximum(sup_chosen, 1.0)
        value = jnp.sum(losses * valid)
        return value, {"loss": value, "chosen_reward": jnp.sum(chosen_reward * valid),
                       "rejected_reward": jnp.sum(rejected_reward * valid),
                       "correct": jnp.sum((h > 0) * valid), "pairs": jnp.sum(valid)}

    def metrics(self, sums: dict) -> dict:
        pairs = jnp.maximum(sums["pairs"], 1.0)
        chosen, rejected = sums["chosen_reward"] / pairs, sums["rejected_reward"] / pairs
        return {"loss": sums["loss"] / pairs, "reward_margin": chosen - rejected,
                "reward_accuracy": sums["correct"] / pairs, "chosen_reward": chosen, "rejected_reward": rejected,
                "pairs": sums["pairs"]}

    def evaluation(self, sums: dict) -> dict[str, float]:
        """Held-out totals -> {loss, reward_margin, reward_accuracy, chosen_reward, rejected_reward, pairs}."""
        return {k: float(v) for k, v in self.metrics(sums).items()}


@dataclasses.dataclass(frozen=True)
class GRPOObjective:
    """GRPO's clipped policy-ratio loss on sampled completions (grpo_loss.GRPOLoss)."""
    loss: GRPOLoss = GRPOLoss()
    multi_step: bool = False  # grpo.num_iterations > 1: the batch carries the sampling weights' old_logp
    scored_from: int = 0  # Q - 1: a completion's first target column (the columns before hold the prompt's)
    name: str = "grpo"
    linear_in_nll = False
    sum_keys = ("value", "count", "tokens", "kl", "clipped_low", "clipped_high")
    count_key = "count"
    metric_keys = ("loss", "kl", "clip_ratio", "clip_ratio_low", "clip_ratio_high")

    @property
    def needs_reference(self) -> bool:
        return self.loss.beta > 0

    @property
    def extra_batch_keys(self) -> tuple[str, ...]:
        return ("advantages", "old_logp") if self.multi_step else ("advantages",)

    def micro_sums(self, nll: jax.Array, reference_nll, batch: dict) -> tuple[jax.Array, dict]:
        """nll, reference_nll (None without KL) [B,S] -> (value to differentiate [], sums [] of sum_keys)."""
        logp = -nll
        old = batch["old_logp"] if self.multi_step else jax.lax.stop_gradient(logp)
        ref = None if reference_nll is None else -reference_nll
        sums = self.loss.sums(logp, old, ref, batch["advantages"], batch["loss_mask"])
        return sums["value"], sums

    def metrics(self, sums: dict) -> dict:
        tokens = jnp.maximum(sums["tokens"], 1.0)
        return {"loss": sums["value"] / jnp.maximum(sums["count"], 1.0), "kl": sums["kl"] / tokens,
                "clip_ratio": (sums["clipped_low"] + sums["clipped_high"]) / tokens,
                "clip_ratio_low": sums["clipped_low"] / tokens, "clip_ratio_high": sums["clipped_high"] / tokens}


def segment_logps(nll: jax.Array, batch: dict) -> tuple[jax.Array, jax.Array]:
    """nll [B,S] -> (sum of -nll * loss_mask per segment [B, S+1], supervised tokens per segment [B, S+1])."""
    mask, segments = batch["loss_mask"], batch["segment_ids"]
    per_row = jax.vmap(lambda values, ids: jax.ops.segment_sum(values, ids, num_segments=mask.shape[1] + 1))
    return per_row(-nll * mask, segments), per_row(mask, segments)


def pair_slices(per_segment: jax.Array) -> tuple[jax.Array, jax.Array]:
    """[B, S+1] per segment -> (segments 1, 3, ..., 2P-1 [B, P], segments 2, 4, ..., 2P [B, P]), P = S // 2."""
    pairs = (per_segment.shape[1] - 1) // 2
    return per_segment[:, 1:2 * pairs:2], per_segment[:, 2:2 * pairs + 1:2]


def fuses_loss_head(name: str) -> bool:
    """Whether objective `name`'s step computes the loss head's gradient with its forward (its value
    is linear in the nll: loss.weighted_nll_sum); the planner counts passes and bytes by it."""
    return {"dpo": DPOObjective, "grpo": GRPOObjective}.get(name, TokenObjective).linear_in_nll


def make_objective(settings):
    """The objective a run's validated settings (zaya_jax.train.settings.Settings) name: train.objective, with
    the dpo section's beta, label_smoothing and rpo_alpha for dpo, the grpo section's loss for grpo."""
    if settings.train.objective == "dpo":
        d = settings.dpo
        return DPOObjective(beta=d.beta, label_smoothing=d.label_smoothing, rpo_alpha=d.rpo_alpha)
    if settings.train.objective == "grpo":
        g = settings.grpo
        return GRPOObjective(GRPOLoss(g.loss_type, g.epsilon, g.epsilon_high or g.epsilon, g.beta,
                                      g.max_completion_length), multi_step=g.num_iterations > 1,
                             scored_from=g.max_prompt_length - 1)
    return TokenObjective(name=settings.train.objective)


def zero_sums(objective) -> dict:
    return {k: jnp.zeros((), jnp.float32) for k in objective.sum_keys}
