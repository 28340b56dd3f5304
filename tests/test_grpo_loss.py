"""GRPO's loss (zaya_jax.train.grpo_loss) against numpy written from TRL's GRPOTrainer: the
advantages for each reward scaling, and the loss and its gradient for each loss type, with
ratios inside and outside the clip range on both sides, a KL penalty, completions of different
lengths and one with no tokens; with one optimisation step per generation batch (old = current
weights) and no KL, the gradient is the policy-gradient estimate by hand; micro-batch sums add up
to the whole batch's loss."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zaya_jax.train.grpo_loss import GRPOLoss, group_advantages

N, T, G = 6, 5, 3


def numpy_advantages(rewards, scale):
    out = np.empty_like(rewards)
    for start in range(0, len(rewards), G):
        group = rewards[start:start + G]
        out[start:start + G] = group - group.mean()
        if scale == "group":
            out[start:start + G] /= group.std(ddof=1) + 1e-4
    if scale == "batch":
        out /= rewards.std(ddof=1) + 1e-4
    return out


def numpy_loss_and_grad(logp, old, ref, adv, mask, loss_type, eps_low, eps_high, beta):
    """TRL's per-token loss and its normalisation, and d loss / d logp by hand (float64)."""
    loss_tok, grad_tok = np.zeros_like(logp), np.zeros_like(logp)
    for i in range(N):
        for t in range(T):
            rho = np.exp(logp[i, t] - old[i, t])
            unclipped, clipped = rho * adv[i], np.clip(rho, 1 - eps_low, 1 + eps_high) * adv[i]
            loss_tok[i, t] = -min(unclipped, clipped)
            grad_tok[i, t] = -rho * adv[i] if unclipped <= clipped else 0.0
            if beta:
                d = ref[i, t] - logp[i, t]
                loss_tok[i, t] += beta * (np.exp(d) - d - 1)
                grad_tok[i, t] += beta * (1 - np.exp(d))
    if loss_type == "grpo":
        lengths = mask.sum(1)
        weights = mask / np.maximum(lengths, 1)[:, None] / (lengths > 0).sum()
    elif loss_type == "dapo":
        weights = mask / mask.sum()
    else:
        weights = mask / (N * T)
    return (loss_tok * weights).sum(), grad_tok * weights


@pytest.fixture(scope="module")
def case():
    rng = np.random.default_rng(0)
    logp = rng.normal(-2, 0.5, (N, T))
    old = logp + rng.choice([-0.6, -0.1, 0.05, 0.4], (N, T))    # ratios below, inside and above the clip range
    old[0, :3] = logp[0, :3] + np.array([-0.6, 0.4, -0.1])        # ... for a completion with A > 0
    old[1, :3] = logp[1, :3] + np.array([0.4, -0.6, 0.05])        # ... and for one with A < 0
    ref = logp + rng.normal(0, 0.3, (N, T))
    rewards = np.array([1.0, 0.0, 1.0, 0.5, 0.5, 0.5])            # the second group's rewards all equal
    mask = (np.arange(T)[None] < np.array([5, 3, 1, 4, 0, 2])[:, None]).astype(np.float64)
    return logp, old, ref, rewards, mask


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_are_trls(case, scale):
    rewards = case[3]
    adv, zero_std = group_advantages(jnp.asarray(rewards, jnp.float32), G, scale)
    np.testing.assert_allclose(np.asarray(adv), numpy_advantages(rewards, scale), rtol=1e-5, atol=1e-6)
    assert float(zero_std) == 0.5


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_loss_and_gradient_are_trls(case, loss_type, beta):
    logp, old, ref, rewards, mask = case
    adv = numpy_advantages(rewards, "group")
    loss = GRPOLoss(loss_type, epsilon_low=0.2, epsilon_high=0.28, beta=beta)
    f = lambda lp: loss.loss(lp, jnp.asarray(old, jnp.float32), jnp.asarray(ref, jnp.float32),  # noqa: E731
                             jnp.asarray(adv, jnp.float32), jnp.asarray(mask, jnp.float32))
    value, grad = jax.value_and_grad(f)(jnp.asarray(logp, jnp.float32))
    want, want_grad = numpy_loss_and_grad(logp, old, ref, adv, mask, loss_type, 0.2, 0.28, beta)
    np.testing.assert_allclose(float(value), want, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=1e-4, atol=1e-7)
    s = loss.sums(jnp.asarray(logp), jnp.asarray(old), jnp.asarray(ref), jnp.asarray(adv), jnp.asarray(mask))
    rho = np.exp(logp - old)
    assert float(s["clipped_low"]) == ((rho < 0.8) & (adv[:, None] < 0) & (mask > 0)).sum() > 0
    assert float(s["clipped_high"]) == ((rho > 1.28) & (adv[:, None] > 0) & (mask > 0)).sum() > 0


def test_one_step_per_batch_without_kl_is_the_policy_gradient(case):
    logp, _, _, rewards, mask = case
    adv = numpy_advantages(rewards, "group")
    lp = jnp.asarray(logp, jnp.float32)
    grad = jax.grad(lambda x: GRPOLoss("dapo").loss(x, x, None, jnp.asarray(adv, jnp.float32),
                                                    jnp.asarray(mask, jnp.float32)))(lp)
    np.testing.assert_allclose(np.asarray(grad), -adv[:, None] * mask / mask.sum(), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_micro_batch_sums_give_the_whole_batchs_loss(case, loss_type):
    logp, old, ref, rewards, mask = case
    adv = jnp.asarray(numpy_advantages(rewards, "group"))
    loss = GRPOLoss(loss_type, beta=0.04)
    args = [jnp.asarray(x) for x in (logp, old, ref)]
    halves = [loss.sums(*(x[part] for x in args), adv[part], jnp.asarray(mask)[part])
              for part in (slice(0, 4), slice(4, N))]
    total = {k: halves[0][k] + halves[1][k] for k in halves[0]}
    whole = loss.loss(*args, adv, jnp.asarray(mask))
    if loss_type == "dr_grpo":  # its count is N * T of each micro-batch: the same sum
        assert float(total["count"]) == N * T
    np.testing.assert_allclose(float(total["value"] / total["count"]), float(whole), rtol=1e-6)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_whole_rows_with_the_completion_budget_sum_as_the_completions(case, loss_type):
    """The train step's layout: [N, S] rows whose mask covers the completion's columns only, the
    advantages along each row, dr_grpo's T given as completion_budget: the same sums as [N, T]."""
    logp, old, ref, rewards, mask = case
    adv = numpy_advantages(rewards, "group")
    q = 4  # prompt columns before the completion
    pad = lambda x, fill: np.concatenate([np.full((N, q), fill), x], axis=1)  # noqa: E731
    rows = [jnp.asarray(pad(x, -3.0)) for x in (logp, old, ref)]
    alone = GRPOLoss(loss_type, beta=0.04).sums(*(jnp.asarray(x) for x in (logp, old, ref)), jnp.asarray(adv),
                                               jnp.asarray(mask))
    whole = GRPOLoss(loss_type, beta=0.04, completion_budget=T).sums(
        *rows, jnp.asarray(np.repeat(adv[:, None], q + T, axis=1)), jnp.asarray(pad(mask, 0.0)))
    for key in alone:
        np.testing.assert_allclose(float(whole[key]), float(alone[key]), rtol=1e-6, err_msg=key)
