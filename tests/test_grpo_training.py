"""GRPO in the trainer (train.objective='grpo') against references it did not produce: the policy
gradient by hand on the model's logits and the rewards recomputed from the decoded completions,
generation from the weights of the step it trains (not those before) by a fresh one-device engine
(the run's engine, on the mesh, is built once and given each generation's weights in place, and
compiles nothing after the first generation), an uninterrupted run (resumes inside a generation
batch and at its boundary), the data-parallel run (a data x fsdp mesh), and evaluate_tasks' greedy
answers (the held-out score).

One small run is shared (module scope): a 1-layer model on the demo tokenizer, 2 prompts x 4
completions of 4 tokens per generation, 2 optimizer steps per generation, KL to the start."""

import json
import os
import re
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from tests.test_engine_serving import compilations
from tests.train_helpers import REPO, cli_env
from zaya_jax.config import ConfigError
from zaya_jax.config_files import load_config_file
from zaya_jax.data import chat_template, instruction_tasks
from zaya_jax.data.sources import tokenizer_path
from zaya_jax.data.tokenizer import Tokenizer
from zaya_jax.evaluation.tasks import answer_tasks
from zaya_jax.model.build import create_model
from zaya_jax.parallel.mesh import make_mesh
from zaya_jax.checkpoints.orbax_checkpoint import load_checkpoint_model
from zaya_jax.train import grpo_batches
from zaya_jax.train.grpo_batches import open_grpo_data
from zaya_jax.train.grpo_rewards import RewardError, exact_answer
from zaya_jax.train.grpo_rollout import Rollout, completion_rows, rollout_engine, sample_groups
from zaya_jax.train.loop import Trainer
from zaya_jax.train.monitor import METRICS_FILE
from zaya_jax.train.settings import settings_from_config

TINY_MODEL = dict(hidden_size=32, num_layers=1, num_q_heads=4, num_kv_heads=2, head_dim=8, num_experts=2,
                  moe_intermediate_size=32, router_hidden_size=8)
G, PROMPTS, T, STEPS = 4, 2, 4, 4


def completion_characters(prompts, completions, **columns):
    """A reward that tells a fresh model's completions apart (exact_answer is 0 for all of them),
    written as for TRL: a conversational prompt's completion is the assistant's message."""
    assert all(isinstance(p, list) for p in prompts) and all(c[0]["role"] == "assistant" for c in completions)
    return [float(len(c[0]["content"])) for c in completions]


def odd_answers_only(prompts, completions, answer, **columns):
    """Tells completions apart (by length) only for a question whose answer is odd: the groups of
    the others have all-equal rewards."""
    return [float(len(c[0]["content"])) if int(a) % 2 else 0.0 for c, a in zip(completions, answer)]


def raising_reward(prompts, completions, **columns):
    raise ValueError("the grader is down")


def same_for_all(prompts, completions, **columns):
    """Every completion scores alike: no group has reward spread."""
    return [1.0] * len(completions)


def documented_seed(train_seed, generation):
    """Generation `generation`'s sampling seed by the documented rule (docs/posttraining.md)."""
    return int(np.random.SeedSequence([train_seed, generation]).generate_state(1)[0])


def documented_prompts(train_seed, count, generation, per_generation):
    """The prompt indices generation `generation` samples by the documented rule: epoch e's order is
    numpy's default_rng([train.seed, e]).permutation(count), taken per_generation at a time."""
    end = (generation + 1) * per_generation
    order = np.concatenate([np.random.default_rng([train_seed, e]).permutation(count) for e in range(end // count + 1)])
    return order[generation * per_generation:end].tolist()


def _config(cache, **grpo):
    config = load_config_file(os.path.join(REPO, "configs/demo_grpo.py"))
    config.model.update(**TINY_MODEL)
    config.data.demo.update(cache_dir=str(cache), max_docs=40)
    config.train.update(init_from_checkpoint="", steps=STEPS, log_every_steps=1)
    config.grpo.update({**dict(prompts_per_step=PROMPTS, num_generations=G, max_completion_length=T, num_iterations=2,
                                beta=0.04, reward_funcs="tests.test_grpo_training:completion_characters,exact_answer",
                                reward_weights="0.5,1"), **grpo})
    config.optimizer.update(learning_rate=1e-2)
    config.eval.update(every_steps=STEPS)
    config.checkpoint.update(every_steps=0)
    config.monitor.update(progress_bar=False, tensorboard=False)
    config.mesh.update(data=-1)  # the 8 fake devices: generation's rows split over them
    return config


class Recording(Trainer):
    """A Trainer that keeps each step's weights, the rows it trained on and the XLA compilations
    while each generation was sampled and scored."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.weights = {int(self.state.step): jax.device_get((self.state.params, self.state.biases))}
        self.first_opt_state = jax.device_get(self.state.opt_state)
        self.rows, self.compiled = {}, {}
        sample = self.data._sample

        def counted(generation):
            with compilations() as compiled:
                rows = sample(generation)
            self.compiled[generation] = compiled
            return rows
        self.data._sample = counted

    def _after_step(self, step):
        self.weights[step] = jax.device_get((self.state.params, self.state.biases))
        self.rows[step] = self.data.rows


def _run(config, workdir, cls=Recording):
    trainer = cls(config, str(workdir))
    try:
        trainer.run()
    finally:
        trainer.close()
    return trainer


def _metrics(workdir, kind="train"):
    with open(os.path.join(workdir, METRICS_FILE)) as f:
        return [r for r in map(json.loads, f) if r["kind"] == kind]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("demo_cache")


@pytest.fixture(scope="module")
def run(cache, tmp_path_factory):
    """The uninterrupted one-device run: generations 0 (steps 1-2) and 1 (steps 3-4), evaluated at 4."""
    workdir = tmp_path_factory.mktemp("grpo")
    return _run(_config(cache), workdir), workdir


def _target_logp(trainer, weights, rows):
    """Per-token log-probs [N, S] of rows' targets from the model's logits (float64 log-softmax)."""
    model = trainer.parts.merge(*weights)
    logits = np.asarray(model(jnp.asarray(rows["inputs"]), segment_ids=jnp.asarray(rows["segment_ids"]),
                              positions=jnp.asarray(rows["positions"])), np.float64)
    logits -= logits.max(-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    return np.take_along_axis(logp, rows["targets"][..., None], -1)[..., 0]


def _tokenizer(trainer):
    return Tokenizer(tokenizer_path(trainer.config.data), bos_id=2, eos_id=1, pad_id=0)


def test_advantages_are_the_group_normalised_rewards_of_the_decoded_completions(run):
    trainer, _ = run
    rows, tok = trainer.rows[1], _tokenizer(trainer)
    stops = {tok.eos_id, *chat_template.end_of_turn_ids(chat_template.ChatTemplate.load(chat_template.PLAIN), tok)}
    texts = [tok.decode([t for t, m in zip(targets, mask) if m and t not in stops])
             for targets, mask in zip(rows["targets"], rows["loss_mask"])]
    chosen = documented_prompts(trainer.settings.train.seed, len(trainer.data._prompts.ids), 0, PROMPTS)
    answers = [trainer.data._prompts.columns["answer"][i] for i in chosen for _ in range(G)]
    rewards = (0.5 * np.asarray([len(t) for t in texts], np.float64)
               + np.asarray(exact_answer(None, texts, answers))).reshape(PROMPTS, G)
    expected = (rewards - rewards.mean(1, keepdims=True)) / (rewards.std(1, ddof=1, keepdims=True) + 1e-4)
    assert np.std(expected) > 0.5  # the step has something to learn from
    np.testing.assert_allclose(rows["advantages"][:, 0], expected.reshape(-1), rtol=1e-5, atol=1e-6)
    assert (rows["advantages"] == rows["advantages"][:, :1]).all()
    first = _metrics(trainer.workdir)[0]
    assert first["reward"] == pytest.approx(rewards.mean(), rel=1e-6)
    assert first["reward_std"] == pytest.approx(rewards.std(1, ddof=1).mean(), rel=1e-5)


def test_the_first_step_is_the_policy_gradient_by_hand(run):
    """One sample per step's weights (ratio 1) and the policy at its reference (the k3 KL's gradient
    is 0 there): the update is the optimizer's on -sum(A * d logp) / completion tokens."""
    trainer, _ = run
    params, biases = trainer.weights[0]
    rows = trainer.rows[1]
    mask, advantages = rows["loss_mask"], rows["advantages"]

    def loss(p):
        model = trainer.parts.merge(p, biases)
        logits = model(jnp.asarray(rows["inputs"]), segment_ids=jnp.asarray(rows["segment_ids"]),
                       positions=jnp.asarray(rows["positions"]))
        logp = jnp.take_along_axis(jax.nn.log_softmax(logits), jnp.asarray(rows["targets"])[..., None], -1)[..., 0]
        return -jnp.sum(advantages * logp * mask) / mask.sum()

    grads = jax.grad(loss)(params)
    assert _metrics(trainer.workdir)[0]["grad_norm"] == pytest.approx(float(optax.tree.norm(grads)), rel=1e-4)
    updates, _ = trainer.tx.update(grads, trainer.first_opt_state, params)
    expected = optax.apply_updates(params, updates)
    after, _ = trainer.weights[1]
    # AdamW's first step is lr * g / (|g| + eps): an embedding row whose gradient is ~eps moves by a
    # fraction of lr that rounding shifts (seen 1e-5); a wrong gradient moves entries by ~lr = 1e-2
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=3e-5), after, expected)
    moved = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(params)))
    assert moved > 1e-4


def test_each_generation_samples_the_weights_of_its_step(run):
    """Generation 1 starts at step 3: its completions are the step-2 model's samples by a fresh engine
    on one device (3 slots for the 8 rows; the run's engine has 8 on the mesh), of the prompts and
    with the seed the documented rules give generation 1 (not generation 0's), and its old_logp that
    model's log-probs, not the weights of step 1 (stale by one step). The run's engine, given those
    weights in place, compiled nothing for generation 1 (generation 0 compiled it)."""
    trainer, _ = run
    rows = trainer.rows[3]
    assert trainer.rows[4] is rows and trainer.rows[2] is trainer.rows[1] and rows is not trainer.rows[1]
    seed, count = trainer.settings.train.seed, len(trainer.data._prompts.ids)
    prompts = [trainer.data._prompts.ids[i] for i in documented_prompts(seed, count, 1, PROMPTS)]
    template = chat_template.ChatTemplate.load(chat_template.PLAIN)
    stop_ids = chat_template.end_of_turn_ids(template, _tokenizer(trainer))
    model, q = trainer.parts.merge(*trainer.weights[2]), trainer.settings.grpo.max_prompt_length
    expected = sample_groups(rollout_engine(model, 3, q, T), prompts, G, T, temperature=1.0,
                             seed=documented_seed(seed, 1), stop_ids=stop_ids, width=q)
    for key, value in expected.rows.items():
        np.testing.assert_array_equal(rows[key], value, err_msg=key)
    mask = rows["loss_mask"] > 0
    np.testing.assert_allclose(rows["old_logp"][mask], _target_logp(trainer, trainer.weights[2], rows)[mask],
                               rtol=1e-5, atol=1e-5)
    stale = _target_logp(trainer, trainer.weights[1], rows)[mask]
    assert np.abs(rows["old_logp"][mask] - stale).max() > 1e-3
    assert trainer.compiled[0] and trainer.compiled[1] == []


def test_the_loss_head_computes_only_the_completion_columns(run):
    """TRL's logits_to_keep: the logits of a step and of old_logp cover the columns from Q - 1 on
    (where a completion's targets start), never the prompt's: old_logp is 0 before them, and the
    lowered train step holds logits [N, S - Q + 1, V] and none of [N, S, V]."""
    from zaya_jax.parallel import distributed
    trainer, _ = run
    rows, q = trainer.rows[3], trainer.settings.grpo.max_prompt_length
    n, s = rows["inputs"].shape
    assert (rows["old_logp"][:, :q - 1] == 0).all() and (rows["old_logp"][:, q - 1:] < 0).any()
    keys = trainer.parts.batch_keys + trainer.objective.extra_batch_keys
    with jax.set_mesh(trainer.mesh):
        batch = distributed.global_batch({k: rows[k] for k in keys}, trainer.mesh)
        hlo = trainer._train_step.lower(trainer.state, batch, trainer.data.phase.rope_theta).as_text()
    vocab = trainer.settings.model.vocab_size
    assert f"tensor<{n}x{s - q + 1}x{vocab}xf32>" in hlo and f"tensor<{n}x{s}x{vocab}xf32>" not in hlo


def test_the_second_step_of_a_generation_weighs_by_the_ratio_to_the_sampling_weights(run):
    """Step 2 trains on generation 0's rows again: its loss is the clipped ratio to the sampling
    weights' old_logp (not 1) plus the k3 KL to the start, by hand in float64."""
    trainer, _ = run
    rows, mask = trainer.rows[2], trainer.rows[2]["loss_mask"]
    logp = _target_logp(trainer, trainer.weights[1], rows)
    ratio = np.exp(logp - rows["old_logp"])
    advantages = rows["advantages"]
    eps = trainer.settings.grpo.epsilon
    policy = -np.minimum(ratio * advantages, np.clip(ratio, 1 - eps, 1 + eps) * advantages)
    delta = _target_logp(trainer, trainer.weights[0], rows) - logp
    per_token = policy + trainer.settings.grpo.beta * (np.exp(delta) - delta - 1)
    assert np.abs(ratio - 1)[mask > 0].max() > 1e-2  # the weights moved since sampling
    expected = (per_token * mask).sum() / mask.sum()
    assert _metrics(trainer.workdir)[1]["loss"] == pytest.approx(expected, rel=1e-4, abs=1e-6)


def test_kl_and_clipping_are_logged_from_the_reference_and_the_sampling_weights(run):
    trainer, _ = run
    records = _metrics(trainer.workdir)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert records[0]["kl"] == 0.0 and records[0]["clip_ratio"] == 0.0  # the policy is its reference, ratio 1
    assert records[1]["kl"] > 0 and records[3]["kl"] > 0
    for r in records:
        assert r["completion_length_min"] <= r["completion_length"] <= r["completion_length_max"] <= T
        assert 0 <= r["frac_reward_zero_std"] <= 1 and r["generation_s"] >= 0 and r["update_s"] > 0
    assert records[0]["generation_s"] > 0 and records[1]["generation_s"] == 0  # one generation per 2 steps


def test_a_generation_without_reward_spread_is_warned_of_once(run, cache, tmp_path, capsys):
    """Rewards that score every completion alike (as a temperature near 0 would make them): the one
    generation of a 2-step run is warned of once, at its first step, in the log and in metrics.jsonl;
    the shared run, whose groups differ, has no warning."""
    _, workdir = run
    assert _metrics(workdir, "warning") == [] and all(r["frac_reward_zero_std"] < 1 for r in _metrics(workdir))
    capsys.readouterr()
    config = _config(cache, reward_funcs="tests.test_grpo_training:same_for_all", reward_weights="")
    config.train.steps = 2  # generation 0 (2 steps)
    config.eval.every_steps = 0
    _run(config, tmp_path, Trainer)
    (warning,) = _metrics(tmp_path, "warning")
    message = f"generation 0: every one of its {PROMPTS} groups scored its {G} completions alike"
    assert warning["step"] == 1 and warning["message"].startswith(message)
    assert "grpo.temperature" in warning["message"] and "grpo.oversample_prompts" in warning["message"]
    assert [r["frac_reward_zero_std"] for r in _metrics(tmp_path)] == [1.0, 1.0]
    assert capsys.readouterr().out.count(f"warning: step 1: {message}") == 1


def test_generations_take_each_epoch_in_a_new_order_and_each_its_own_seed(cache, tmp_path, monkeypatch):
    """5 prompts, 2 per generation: generations 0-4 sample two whole epochs (one generation straddles
    the boundary). What each generation hands to sampling is the documented order's prompts (every
    prompt once per epoch, the second epoch in another order) with the documented seed of that
    generation. No model: the sampler is replaced by one that records its prompts and seed."""
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"question {i}", "answer": str(i)}) + "\n" for i in range(5)))
    config = _config(cache, prompts=str(path), num_iterations=1, beta=0.0, reward_funcs="exact_answer",
                     reward_weights="")
    data = open_grpo_data(config, settings_from_config(config), tokenizer_path(config.data))
    calls = []

    def recording_sampler(engine, prompts, group_size, max_new_tokens, *, seed, width, **options):
        calls.append(([list(p) for p in prompts], seed))
        repeated = [list(p) for p in prompts for _ in range(group_size)]
        completions = np.ones((len(repeated), max_new_tokens), np.int32)  # eos at once: empty answers
        lengths = np.ones(len(repeated), np.int32)
        return Rollout(completion_rows(repeated, completions, lengths, width, 0), completions, lengths, width)

    monkeypatch.setattr(grpo_batches, "sample_groups", recording_sampler)
    model = create_model(settings_from_config(config).model, seed=0)  # the rollout engine's; it never runs
    data.attach(lambda: model, None, None)
    for _ in range(5):
        next(data)
    ids = [list(p) for p in data._prompts.ids]
    sampled = [[ids.index(p) for p in prompts] for prompts, _ in calls]
    seed = config.train.seed
    assert sampled == [documented_prompts(seed, 5, g, 2) for g in range(5)]
    first, second = sum(sampled, [])[:5], sum(sampled, [])[5:]
    assert sorted(first) == sorted(second) == list(range(5)) and first != second
    seeds = [s for _, s in calls]
    assert seeds == [documented_seed(seed, g) for g in range(5)] and len(set(seeds)) == 5
    assert data.state_problem(data.get_state()) is None  # what a resume checks before it continues
    assert data.state_problem({"phase": 2}) == "is not a GRPO run's (it holds phase)"


def test_the_heldout_score_is_the_greedy_answers_evaluate_tasks_gives(run):
    trainer, workdir = run
    (record,) = _metrics(workdir, "eval")
    model, step = load_checkpoint_model(str(workdir), None)
    assert step == STEPS
    tasks = instruction_tasks.tasks("heldout", 1)
    template = chat_template.ChatTemplate.load(chat_template.PLAIN)
    texts = answer_tasks(model, _tokenizer(trainer), template, tasks, T, batch_size=len(tasks))
    chars = np.mean([len(t) for t in texts])
    accuracy = np.mean([instruction_tasks.is_correct(t, c) for t, c in zip(tasks, texts)])
    assert record["eval/prompts/exact_answer"] == pytest.approx(accuracy)
    assert record["eval/prompts/completion_characters"] == pytest.approx(chars)
    assert record["eval/prompts/reward"] == pytest.approx(0.5 * chars + accuracy)


@pytest.mark.parametrize("stop", [2, 3])
def test_a_resumed_run_equals_the_uninterrupted_one(run, cache, tmp_path, stop):
    """Stopped after step 3 (the first of generation 1's two steps: its rows are checkpointed) or
    step 2 (generation 0's last: the resumed run's new engine samples generation 1 from the
    restored weights)."""
    trainer, workdir = run
    config = _config(cache)
    config.eval.every_steps = 0
    config.train.steps = stop
    _run(config, tmp_path, Trainer)
    config.train.steps = STEPS
    resumed = _run(config, tmp_path)
    assert set(resumed.rows) == set(range(stop + 1, STEPS + 1))
    for step in resumed.rows:
        for key, value in trainer.rows[step].items():
            np.testing.assert_array_equal(resumed.rows[step][key], value, err_msg=f"step {step}: {key}")
    jax.tree.map(np.testing.assert_array_equal, resumed.weights[4], trainer.weights[4])
    assert _metrics(tmp_path)[-1]["loss"] == _metrics(workdir)[-1]["loss"]


def test_a_data_fsdp_mesh_trains_as_data_parallelism(run, cache, tmp_path):
    """(Not expert > 1: expert parallelism on the CPU has a fixed capacity and drops tokens, which
    the logged drop_rate shows.)"""
    trainer, workdir = run
    config = _config(cache)
    config.train.steps = 2
    config.eval.every_steps = 0
    config.mesh.update(data=2, fsdp=4)
    sharded = _run(config, tmp_path)
    assert dict(sharded.mesh.shape)["fsdp"] == 4
    for key in ("inputs", "targets", "loss_mask"):
        np.testing.assert_array_equal(sharded.rows[1][key], trainer.rows[1][key], err_msg=key)
    np.testing.assert_allclose(sharded.rows[1]["advantages"], trainer.rows[1]["advantages"], rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5), sharded.weights[2],
                 trainer.weights[2])  # 7e-7 seen; expert=2's dropped tokens move them by 2e-2
    for mine, theirs in zip(_metrics(tmp_path), _metrics(workdir)):
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=1e-4, abs=1e-6)


def test_a_reward_that_raises_is_named_and_the_checkpoints_stay(run, cache, tmp_path):
    _, workdir = run
    shutil.copytree(workdir, tmp_path / "run")
    config = _config(cache, reward_funcs="tests.test_grpo_training:raising_reward", reward_weights="")
    config.train.steps = STEPS + 2
    trainer = Trainer(config, str(tmp_path / "run"))
    try:
        with pytest.raises(RewardError, match="reward function raising_reward raised ValueError: the grader is down"):
            trainer.run()
    finally:
        trainer.close()
    model, step = load_checkpoint_model(str(tmp_path / "run"), None)
    assert step == STEPS


def test_oversampled_prompts_train_the_groups_whose_rewards_differ(run, cache):
    """grpo.oversample_prompts = 3 (DAPO's dynamic sampling at a fixed batch): a generation samples
    3 x 2 prompts and trains on the first 2 groups whose rewards differ, with their advantages; the
    reference is one device's samples of all 6 and their rewards by hand."""
    trainer, _ = run
    config = _config(cache, oversample_prompts=3, num_iterations=1, beta=0.0, reward_weights="",
                     reward_funcs="tests.test_grpo_training:odd_answers_only")
    data = open_grpo_data(config, settings_from_config(config), tokenizer_path(config.data))
    model = trainer.current_model(data.phase.rope_theta)
    data.attach(lambda: model, None, trainer.mesh)
    next(data)
    q = trainer.settings.grpo.max_prompt_length
    chosen = documented_prompts(trainer.settings.train.seed, len(data._prompts.ids), 0, 3 * PROMPTS)
    template = chat_template.ChatTemplate.load(chat_template.PLAIN)
    tok = _tokenizer(trainer)
    every = sample_groups(rollout_engine(model, 3 * PROMPTS * G, q, T), [data._prompts.ids[i] for i in chosen], G, T,
                          temperature=1.0, seed=documented_seed(trainer.settings.train.seed, 0),
                          stop_ids=chat_template.end_of_turn_ids(template, tok), width=q)
    texts = data.decode(every.completions, every.lengths)
    answers = [int(data._prompts.columns["answer"][i]) for i in chosen for _ in range(G)]
    rewards = np.asarray([len(t) if a % 2 else 0.0 for t, a in zip(texts, answers)]).reshape(-1, G)
    differ = [k for k in range(3 * PROMPTS) if np.ptp(rewards[k]) > 0]
    assert len(differ) >= PROMPTS and differ[:PROMPTS] != list(range(PROMPTS))  # a group was passed over
    rows = data.rows
    for key in ("inputs", "targets", "loss_mask"):
        expected = np.concatenate([every.rows[key][k * G:(k + 1) * G] for k in differ[:PROMPTS]])
        np.testing.assert_array_equal(rows[key], expected, err_msg=key)
    kept = rewards[differ[:PROMPTS]]
    advantages = (kept - kept.mean(1, keepdims=True)) / (kept.std(1, ddof=1, keepdims=True) + 1e-4)
    np.testing.assert_allclose(rows["advantages"][:, 0], advantages.reshape(-1), rtol=1e-5, atol=1e-6)
    zero = np.mean([np.ptp(r) == 0 for r in rewards])
    assert data.stats["frac_trained_zero_std"] == 0 and data.stats["frac_reward_zero_std"] == pytest.approx(zero)


@pytest.mark.parametrize("field, value, message", [
    ("reward_funcs", "no_such_reward", "grpo.reward_funcs: 'no_such_reward' is neither a built-in reward"),
    ("reward_funcs", "tests.test_grpo_training:missing", "grpo.reward_funcs: 'tests.test_grpo_training:missing': "
                                                         "module 'tests.test_grpo_training' ("),
    ("reward_funcs", "my_rewards:score", "grpo.reward_funcs: 'my_rewards:score': no module named 'my_rewards'. A "
                                         "'module:function' reward is imported from sys.path, as any Python import: "
                                         "the current directory ("),
    ("reward_weights", "1,2,3", "grpo.reward_weights: 3 weights for 2 reward functions"),
    ("prompts", "/nonexistent/prompts.jsonl", "grpo.prompts: '/nonexistent/prompts.jsonl' is not a file"),
    ("max_prompt_length", 8, "grpo.prompts: prompt 1 of demo:tasks has"),
    ("num_generations", 1, "grpo.num_generations must be >= 2"),
    ("oversample_prompts", 0, "grpo.oversample_prompts must be > 0, got 0"),
    ("oversample_prompts", 1000, "grpo.prompts: demo:tasks holds 95 prompts, fewer than the 2000 a generation samples"),
    ("eval_prompts", "", "eval.every_steps > 0 scores grpo.eval_prompts, which is empty"),
    ("loss_type", "ppo", "grpo.loss_type='ppo' does not exist"),
    ("temperature", 0.0, "grpo.temperature must be > 0, got 0.0: at 0 a prompt's G completions are all its greedy"),
    ("rollout_slots", 0, "grpo.rollout_slots must be > 0, got 0"),
])
def test_a_bad_grpo_setting_is_named_before_anything_compiles(cache, field, value, message):
    config = _config(cache, **{field: value})
    with pytest.raises(ConfigError, match=re.escape(message)):
        open_grpo_data(config, settings_from_config(config), tokenizer_path(config.data))


def test_rollout_slots_that_do_not_split_over_the_mesh_are_named_before_anything_compiles(cache):
    """4 slots (fewer than a generation's 8 rows) on a data=2 x fsdp=4 mesh: the engine's rows split
    over the 8 batch shards, so the trainer's attach refuses it, naming the setting and the fix."""
    config = _config(cache, rollout_slots=4)
    settings = settings_from_config(config)
    data = open_grpo_data(config, settings, tokenizer_path(config.data))
    model = create_model(settings.model, seed=0)
    with pytest.raises(ConfigError, match=re.escape(
            "GRPO's rollout engine (grpo.rollout_slots=4, 4 decode rows): slots=4 does not split over "
            "data=2 x fsdp=4 = 8") + "(?s:.*)fix: slots a multiple of 8, e.g. 8"):
        data.attach(lambda: model, None, make_mesh({"data": 2, "fsdp": 4, "expert": 1, "tensor": 1, "context": 1}))


def test_a_prompts_file_without_a_rewards_column_is_named_before_anything_compiles(cache, tmp_path):
    """exact_answer reads the prompts' `answer` column: a file without it is named, with the column, in
    one error line of the train CLI (before, the first generation's rewards raised a TypeError)."""
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "2 + 2 =", "solution": "4"}\n')
    overrides = [f"--config.grpo.prompts={path}", "--config.train.init_from_checkpoint=",
                 f"--config.data.demo.cache_dir={cache}", "--config.data.demo.max_docs=40",
                 *(f"--config.model.{k}={v}" for k, v in TINY_MODEL.items())]
    done = subprocess.run([sys.executable, "-m", "zaya_jax.train", "--config", "configs/demo_grpo.py",
                           "--workdir", str(tmp_path / "run"), *overrides], cwd=REPO, env=cli_env(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and done.stderr.strip().splitlines()[-1:] == [
        f"error: grpo.prompts: {path} has no column 'answer', which reward function exact_answer (grpo.reward_funcs) "
        "takes; its records have prompt, solution: add 'answer' to every record, or choose reward functions that "
        "read only those"], done.stderr[-3000:]


def test_prompt_files_take_text_and_conversations_with_their_columns(cache, tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "2 + 2 =", "answer": "4"}\n'
                    '{"prompt": [{"role": "user", "content": "What is 3 + 4?"}], "answer": "7"}\n')
    config = _config(cache, prompts=str(path))
    data = open_grpo_data(config, settings_from_config(config), tokenizer_path(config.data))
    prompts = data._prompts
    tok = Tokenizer(tokenizer_path(config.data), bos_id=2, eos_id=1, pad_id=0)
    template = chat_template.ChatTemplate.load(chat_template.PLAIN)
    np.testing.assert_array_equal(prompts.ids[0], [2, *tok.encode("2 + 2 =")])
    np.testing.assert_array_equal(prompts.ids[1], chat_template.encode_prompt(
        template, tok, [{"role": "user", "content": "What is 3 + 4?"}]))
    assert prompts.columns == {"answer": ["4", "7"]}
    path.write_text('{"prompt": "a", "answer": "1"}\n{"prompt": "b"}\n')
    with pytest.raises(ConfigError, match="line 2 has the fields"):
        open_grpo_data(config, settings_from_config(config), tokenizer_path(config.data))
