"""GRPO's training data: each generation batch sampled from the policy's current weights, scored
by the reward functions, as train rows with group-relative advantages (train.objective='grpo').

P = grpo.prompts_per_step prompts, G = grpo.num_generations, N = P * G rows (the global batch) of
S = Q + T - 1 positions (Q = grpo.max_prompt_length, T = grpo.max_completion_length; the layout
of grpo_rollout: each prompt right-aligned at column Q, its completion after it).

  generation g (one every grpo.num_iterations steps):
    prompts     the next k * P of grpo.prompts (k = grpo.oversample_prompts, default 1), in an order
                shuffled per epoch by (train.seed, epoch)
    sample      G completions of each from the policy's weights now (grpo_rollout.sample_groups:
                the run's one serving engine, given these weights in place, grpo.rollout_slots
                decode rows; seeded by (train.seed, g), each row by (that seed, its index);
                stops: eos and the chat template's end of turn), decoded up to their stop
    rewards     grpo_rewards.combine_rewards(reward functions, weights, prompts, completions, the
                prompts' columns) [k * N]
    trained     P of the k * P groups (trained_groups): those whose rewards differ first, in prompt
                order (with k > 1, DAPO's dynamic sampling at a fixed batch: the all-equal groups,
                whose advantages are 0, make way for groups the step learns from)
    advantages  grpo_loss.group_advantages(their rewards, G, grpo.scale_rewards) [N], along each row [N, S]
    old_logp    with num_iterations > 1: the sampling weights' per-token log-probs [N, S]
  each of the num_iterations steps of g trains on the same rows (this process's share).

State (checkpointed with the train state): the generation and the step within it, and inside a
generation (a stop after one of its steps but the last) its rows, so that a resumed run trains on
exactly the rows the uninterrupted one does: a generation is a function of the weights that
start it and its seed.

`stats` (logged with every train record): reward (mean) and reward_std (each group's, averaged),
each reward function's mean (rewards/NAME), frac_reward_zero_std (groups whose rewards are all
equal: no signal), all over the k * P sampled groups, frac_trained_zero_std (the same share among
the P trained: below frac_reward_zero_std when k > 1 finds groups that differ), completion_length
(mean, min, max), clipped_completion_ratio (completions that reached T without a stop).
`generation_seconds` adds up the time spent sampling and scoring. A generation whose groups all have
equal rewards (frac_reward_zero_std 1: nothing to learn) leaves a warning, which the trainer logs
and writes to metrics.jsonl once (`take_warning`).
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable

import grain
import jax
import numpy as np

from zaya_jax.config import ConfigError
from zaya_jax.data import chat_template
from zaya_jax.data.curriculum import PhaseInfo
from zaya_jax.data.pipeline import foreign_state
from zaya_jax.data.tokenizer import Tokenizer
from zaya_jax.evaluation.answering import generate_completions
from zaya_jax.infer.static_loop import stop_tokens
from zaya_jax.parallel.distributed import local_batch_rows
from zaya_jax.train.grpo_loss import group_advantages
from zaya_jax.train.grpo_prompts import PromptSet, load_prompts
from zaya_jax.train.grpo_rewards import check_reward_columns, combine_rewards, resolve_rewards, reward_name
from zaya_jax.engine.placement import check_mesh
from zaya_jax.train.grpo_rollout import rollout_engine, sample_groups
from zaya_jax.train.settings import Settings


def grpo_phase(settings: Settings) -> PhaseInfo:
    """The one 'phase' of a GRPO run: batches of prompts_per_step * G rows of Q + T - 1 positions."""
    g, t = settings.grpo, settings.train
    rows, seq_len = g.prompts_per_step * g.num_generations, g.max_prompt_length + g.max_completion_length - 1
    return PhaseInfo(index=0, name="grpo", token_budget=t.steps * rows * seq_len, seq_len=seq_len,
                     rope_theta=settings.model.rope_theta, global_batch_size=rows, weights=(("prompts", 1.0),))


class GRPOBatches(grain.DatasetIterator):
    """The module's generation batches; `attach` gives it the policy before the first `next`."""

    def __init__(self, settings: Settings, prompts: PromptSet, eval_prompts: PromptSet | None,
                 tokenizer: Tokenizer, template: chat_template.ChatTemplate, rewards: list[Callable],
                 weights: list[float] | None):
        super().__init__()
        self.phase = grpo_phase(settings)
        self.chat_template = template.record()  # what the run's checkpoints record
        self._grpo, self._seed = settings.grpo, settings.train.seed
        self._prompts, self._eval_prompts, self._tokenizer = prompts, eval_prompts, tokenizer
        self._rewards, self._weights = rewards, weights
        self._stop_ids = tuple(chat_template.end_of_turn_ids(template, tokenizer))
        self._stops = set(stop_tokens(tokenizer.eos_id, self._stop_ids))
        self._rows = local_batch_rows(self.phase.global_batch_size)
        self._policy: Callable | None = None
        self._old_logps: Callable | None = None
        self._engine = None
        self._generation, self._iteration, self._batch = 0, 0, None
        self.stats: dict[str, float] = {}
        self.generation_seconds = 0.0
        self._warning: str | None = None

    def attach(self, policy: Callable, old_logps: Callable, mesh: jax.sharding.Mesh | None) -> None:
        """policy() -> the model at the current weights; old_logps(rows {k: [N, S]}) -> their per-token
        log-probs [N, S] under the current weights; mesh: the rollout engine's (its slots split over
        data, its weights placed by the trainer's rules). Builds the run's rollout engine from policy():
        a mesh its slots do not split over is a ConfigError here, before anything compiles."""
        g, model = self._grpo, policy()
        slots = min(g.rollout_slots, g.oversample_prompts * self.phase.global_batch_size)  # no idle rows
        if mesh is not None:
            check_mesh(model, dict(mesh.shape), slots, f"GRPO's rollout engine (grpo.rollout_slots={g.rollout_slots}, "
                       f"{slots} decode rows)", lambda axis, size: f"--config.mesh.{axis}={size}")
        self._policy, self._old_logps = policy, old_logps
        self._engine = rollout_engine(model, slots, g.max_prompt_length, g.max_completion_length, mesh)

    @property
    def rows(self) -> dict[str, np.ndarray] | None:
        """The global rows {k: [N, S]} of the generation the last batch came from (None before any)."""
        return self._batch

    def __next__(self) -> dict[str, np.ndarray]:
        if self._iteration == 0:
            self._batch = self._sample(self._generation)
        batch = {k: v[self._rows] for k, v in self._batch.items()}
        self._iteration += 1
        if self._iteration == self._grpo.num_iterations:
            self._generation, self._iteration = self._generation + 1, 0
        return batch

    def take_warning(self) -> str | None:
        """What the last generation sampled warns of, once (then None): every one of its groups had
        equal rewards (no_spread_warning)."""
        warning, self._warning = self._warning, None
        return warning

    def get_state(self) -> dict[str, Any]:
        state: dict[str, Any] = {"grpo_generation": self._generation, "grpo_iteration": self._iteration}
        if self._iteration:
            state["rows"] = {k: {"dtype": v.dtype.name, "values": v.tolist()} for k, v in self._batch.items()}
        return state

    def state_problem(self, state: dict[str, Any]) -> str | None:
        """Why this iterator cannot continue from `state` (a saved get_state()), or None."""
        return None if "grpo_generation" in state else foreign_state(state, "GRPO run")

    def set_state(self, state: dict[str, Any]) -> None:
        self._generation, self._iteration = state["grpo_generation"], state["grpo_iteration"]
        self._batch = None
        if self._iteration:
            self._batch = {k: np.asarray(v["values"], v["dtype"]) for k, v in state["rows"].items()}

    def close(self) -> None:
        pass

    # -- one generation ---------------------------------------------------------------------------
    @functools.lru_cache(maxsize=2)
    def _epoch_order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self._seed, epoch]).permutation(len(self._prompts.ids))

    def prompt_indices(self, generation: int) -> list[int]:
        """The prompts generation `generation` samples: the next oversample_prompts * prompts_per_step
        of the shuffled epochs."""
        n, per = len(self._prompts.ids), self._grpo.oversample_prompts * self._grpo.prompts_per_step
        return [int(self._epoch_order(k // n)[k % n]) for k in range(generation * per, (generation + 1) * per)]

    def sample_seed(self, generation: int) -> int:
        return int(np.random.SeedSequence([self._seed, generation]).generate_state(1)[0])

    def _sample(self, generation: int) -> dict[str, np.ndarray]:
        if self._engine is None:
            raise RuntimeError("GRPOBatches.attach(policy, ...) must come before the first batch")
        g, started = self._grpo, time.perf_counter()
        chosen = self.prompt_indices(generation)
        self._engine.set_weights(self._policy())
        rollout = sample_groups(self._engine, [self._prompts.ids[i] for i in chosen], g.num_generations,
                                g.max_completion_length, temperature=g.temperature, top_k=g.top_k or None,
                                top_p=g.top_p if g.top_p < 1 else None, seed=self.sample_seed(generation),
                                stop_ids=self._stop_ids, width=g.max_prompt_length)
        texts = self.decode(rollout.completions, rollout.lengths)
        rewards, per_reward = self.score([i for i in chosen for _ in range(g.num_generations)], self._prompts, texts)
        _, zero_std = group_advantages(rewards, g.num_generations, g.scale_rewards)
        groups = trained_groups(rewards, g.num_generations, g.prompts_per_step)
        kept = (groups[:, None] * g.num_generations + np.arange(g.num_generations)).reshape(-1)  # their rows
        advantages, trained_zero_std = group_advantages(rewards[kept], g.num_generations, g.scale_rewards)
        rows = {k: v[kept] for k, v in rollout.rows.items()}
        rows["advantages"] = np.repeat(np.asarray(advantages, np.float32)[:, None], rows["inputs"].shape[1], axis=1)
        if g.num_iterations > 1:
            rows["old_logp"] = np.asarray(self._old_logps(rows), np.float32)
        self.generation_seconds += time.perf_counter() - started
        self._warning = no_spread_warning(generation, rewards, g.num_generations) if zero_std == 1 else None
        stopped = np.asarray([self._ends_in_stop(row, n) for row, n in zip(rollout.completions, rollout.lengths)])
        self.stats = {"reward": float(rewards.mean()),
                      "reward_std": float(rewards.reshape(-1, g.num_generations).std(axis=1, ddof=1).mean()),
                      **{f"rewards/{reward_name(r)}": float(v.mean()) for r, v in zip(self._rewards, per_reward)},
                      "frac_reward_zero_std": float(zero_std), "frac_trained_zero_std": float(trained_zero_std),
                      "completion_length": float(rollout.lengths.mean()),
                      "completion_length_min": int(rollout.lengths.min()),
                      "completion_length_max": int(rollout.lengths.max()),
                      "clipped_completion_ratio": float(1 - stopped.mean())}
        return rows

    def _ends_in_stop(self, tokens: np.ndarray, length: int) -> bool:
        return length > 0 and int(tokens[length - 1]) in self._stops

    def decode(self, completions: np.ndarray, lengths: np.ndarray) -> list[str]:
        """Each completion's text, without its stop token."""
        return [self._tokenizer.decode(row[:n - self._ends_in_stop(row, n)].tolist())
                for row, n in zip(completions, lengths)]

    def score(self, indices: list[int], prompts: PromptSet, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Rewards of completions `texts` of prompts[indices] -> (weighted sum [N], per reward [R, N]); a
        conversational prompt's completion goes to the reward functions as TRL passes it, the
        assistant's message [{"role": "assistant", "content": text}]."""
        chosen = [prompts.prompts[i] for i in indices]
        completions = [t if isinstance(p, str) else [{"role": "assistant", "content": t}] for p, t in zip(chosen, texts)]
        return combine_rewards(self._rewards, self._weights, chosen, completions,
                               {k: [v[i] for i in indices] for k, v in prompts.columns.items()})

    def evaluate(self, model) -> dict[str, float]:
        """Greedy completions of grpo.eval_prompts by `model` -> {reward: the weighted mean, NAME: each
        reward function's mean} (exact_answer's mean is the held-out accuracy)."""
        prompts = self._eval_prompts
        texts = generate_completions(model, self._tokenizer, prompts.ids, self._grpo.max_completion_length,
                                     self.phase.global_batch_size, self._stop_ids)
        total, per_reward = self.score(list(range(len(prompts.ids))), prompts, texts)
        return {"reward": float(total.mean()),
                **{reward_name(r): float(v.mean()) for r, v in zip(self._rewards, per_reward)}}


def no_spread_warning(generation: int, rewards: np.ndarray, group_size: int) -> str:
    """The warning for a generation whose groups (rewards [K * G]) each scored their G completions alike."""
    groups = len(rewards) // group_size
    return (f"generation {generation}: every one of its {groups} groups scored its {group_size} completions "
            f"alike (zero reward spread; mean reward {float(np.mean(rewards)):.3f}): every advantage is 0, so its "
            "steps learn nothing from the rewards. If it persists, the prompts are too hard or too easy for the "
            "model, or its samples too alike: raise grpo.temperature, or sample more prompts to choose from "
            "(grpo.oversample_prompts)")


def trained_groups(rewards: np.ndarray, group_size: int, keep: int) -> np.ndarray:
    """rewards [K * G] of K groups (consecutive) -> the `keep` groups a step trains on, ascending:
    every group whose rewards are not all equal (in order) before any whose are, the first `keep`."""
    groups = np.asarray(rewards).reshape(-1, group_size)
    differ = groups.max(axis=1) > groups.min(axis=1)
    return np.sort(np.argsort(~differ, kind="stable")[:keep])


def open_grpo_data(config, settings: Settings, tokenizer_file: str | None) -> GRPOBatches:
    """A GRPO run's batches: its tokenizer (`tokenizer_file`: data.tokenizer as the trainer resolved
    and checked it against the checkpoint it starts from), chat template, prompts and reward
    functions, each checked here (ConfigError naming the field) before anything compiles."""
    g = settings.grpo
    if jax.process_count() > 1:
        raise ConfigError("train.objective='grpo' runs in one process (its samples are scored on the host); "
                          "run it on one host's devices")
    if tokenizer_file is None:
        raise ConfigError("train.objective='grpo' decodes completions for its rewards with data.tokenizer: set it "
                          "(a tokenizer.json, or 'demo:tokenizer')")
    cfg = settings.model
    tokenizer = Tokenizer(tokenizer_file, bos_id=cfg.bos_token_id, eos_id=cfg.eos_token_id, pad_id=cfg.pad_token_id)
    template = chat_template.ChatTemplate.load(g.chat_template or chat_template.PLAIN)
    rewards, weights = resolve_rewards(g.reward_funcs, g.reward_weights)
    demo = config.data.demo.to_dict() if "demo" in config.data else {}
    prompts = load_prompts(g.prompts, "grpo.prompts", tokenizer, template, g.max_prompt_length, demo)
    check_reward_columns(rewards, list(prompts.columns), g.prompts, "grpo.prompts")
    if len(prompts.ids) < g.oversample_prompts * g.prompts_per_step:
        raise ConfigError(f"grpo.prompts: {g.prompts} holds {len(prompts.ids)} prompts, fewer than the "
                          f"{g.oversample_prompts * g.prompts_per_step} a generation samples (grpo.oversample_prompts="
                          f"{g.oversample_prompts} x grpo.prompts_per_step={g.prompts_per_step})")
    eval_prompts = (load_prompts(g.eval_prompts, "grpo.eval_prompts", tokenizer, template, g.max_prompt_length, demo)
                    if g.eval_prompts else None)
    if eval_prompts is not None:
        check_reward_columns(rewards, list(eval_prompts.columns), g.eval_prompts, "grpo.eval_prompts")
    return GRPOBatches(settings, prompts, eval_prompts, tokenizer, template, rewards, weights)
