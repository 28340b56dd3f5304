"""Post-training objectives (train.objective sft / dpo) against references the trainer did not
produce: numpy over the model's logits, one device, an uninterrupted run, the source checkpoint."""

import functools
import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from tests.model_fixtures import TINY, tiny_model
from tests.test_proof_sharded_training import _config, _initial_model, assert_states_close
from zaya_jax.config import ConfigError
from zaya_jax.config_files import load_config_file, model_config
from zaya_jax.data import prepare
from zaya_jax.errors import UserError
from zaya_jax.model.build import create_model
from zaya_jax.planner.step_plan import StepShape, plan
from zaya_jax.train import balancing
from zaya_jax.checkpoints.orbax_checkpoint import config_json, load_checkpoint_model, save_model
from zaya_jax.train.data import open_training_data, synthetic_batch
from zaya_jax.train.loop import Trainer
from zaya_jax.train.objectives import DPOObjective, TokenObjective, make_objective
from zaya_jax.train.optimizer import make_optimizer, schedule
from zaya_jax.train.settings import BalancingSettings, settings_from_config
from zaya_jax.checkpoints.model_parts import ModelParts
from zaya_jax.train.state import initial_state
from zaya_jax.train.step import train_step

B, S = 4, 32
CONTROLLER = balancing.make_controller(BalancingSettings(rate=1e-2))
SGD = optax.sgd(1.0)  # params move by exactly -grad: gradients are read back from the params


@functools.lru_cache(maxsize=None)
def _step(objective, microbatches=1):
    return jax.jit(functools.partial(
        train_step, parts=ModelParts(tiny_model()), tx=SGD, controller=CONTROLLER, lr_schedule=lambda count: 0.0,
        rope_theta=TINY.rope_theta, microbatches=microbatches, loss_chunk=8, balance=True, include_skip=False,
        mesh=None, objective=objective))


def _logits(params, biases, batch):
    model = ModelParts(tiny_model()).merge(params, biases)
    return model(batch["inputs"], segment_ids=batch["segment_ids"], positions=batch["positions"])


def _np_log_softmax(logits):
    x = np.asarray(logits, np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _np_target_logp(logits, targets):
    return np.take_along_axis(_np_log_softmax(logits), np.asarray(targets)[..., None], -1)[..., 0]


def test_sft_loss_is_the_masked_token_mean_by_hand():
    batch = synthetic_batch(0, 0, B, S, TINY.vocab_size, slice(None), "sft")
    mask = batch["loss_mask"]
    in_document = batch["segment_ids"][:, 1:] == batch["segment_ids"][:, :-1]
    assert 0 < mask.sum() < in_document.sum(), "some in-document targets (the prompts) are unsupervised"
    params, biases = ModelParts.arrays(tiny_model())
    _, metrics = _step(TokenObjective("sft"))(initial_state(params, biases, SGD, CONTROLLER, 0), batch)
    logp = _np_target_logp(jax.jit(_logits)(params, biases, batch), batch["targets"])
    np.testing.assert_allclose(metrics["loss"], -(logp * mask).sum() / mask.sum(), rtol=1e-5)
    assert int(metrics["tokens"]) == int(mask.sum())


def _numpy_dpo(policy_logits, reference_logits, batch, beta, ls, rpo_alpha=0.0):
    """(loss, margin, accuracy, pairs, dL/dpolicy_logits [B,S,V]): DPO written out from the paper
    (float64), plus rpo_alpha times the chosen completion's token-mean nll (RPO, TRL's rpo_alpha)."""
    mask, segments, targets = batch["loss_mask"], batch["segment_ids"], batch["targets"]
    logp, ref_logp = _np_target_logp(policy_logits, targets), _np_target_logp(reference_logits, targets)
    grad_seq = np.zeros((B, S + 1))  # dL / d(sequence log-prob) per segment
    losses, margins, wins, terms = [], [], [], []
    for r in range(B):
        for j in range(1, S // 2 + 1):
            c, rj = segments[r] == 2 * j - 1, segments[r] == 2 * j
            if mask[r][c].sum() == 0 or mask[r][rj].sum() == 0:
                continue
            pc, pr = (logp[r] * mask[r])[c].sum(), (logp[r] * mask[r])[rj].sum()
            rc, rr = (ref_logp[r] * mask[r])[c].sum(), (ref_logp[r] * mask[r])[rj].sum()
            z = beta * ((pc - rc) - (pr - rr))
            sig = 1 / (1 + np.exp(-z))
            chosen_tokens = mask[r][c].sum()
            losses.append(-(1 - ls) * np.log(sig) - ls * np.log(1 - sig) - rpo_alpha * pc / chosen_tokens)
            margins.append(z)
            wins.append(z > 0)
            terms.append((r, 2 * j - 1, 2 * j, -(1 - ls) * (1 - sig) + ls * sig,  # dloss/dz
                          -rpo_alpha / chosen_tokens))  # dloss/dpc of the nll term
    n = len(losses)
    for r, kc, kr, dz, dnll in terms:
        grad_seq[r, kc] += (dz * beta + dnll) / n
        grad_seq[r, kr] -= dz * beta / n
    probs = np.exp(_np_log_softmax(policy_logits))
    onehot = np.eye(probs.shape[-1])[targets]
    per_token = np.take_along_axis(grad_seq, segments, 1) * mask  # [B,S]
    grad_logits = per_token[..., None] * (onehot - probs)  # d logp[target] / d logits = onehot - softmax
    return np.mean(losses), np.mean(margins), np.mean(wins), n, grad_logits


@pytest.mark.parametrize("rpo_alpha", [0.0, 1.5])
def test_dpo_loss_and_gradients_equal_numpy(rpo_alpha):
    batch = synthetic_batch(0, 0, B, S, TINY.vocab_size, slice(None), "dpo")
    params, biases = ModelParts.arrays(tiny_model())
    ref_params, _ = ModelParts.arrays(create_model(TINY, seed=1))
    ref_biases = 0.1 * jax.random.normal(jax.random.key(3), biases.shape)  # the reference's own biases are used
    state = initial_state(params, biases, SGD, CONTROLLER, 0).replace(
        reference={"params": ref_params, "biases": ref_biases})
    objective = DPOObjective(beta=0.5, label_smoothing=0.1, rpo_alpha=rpo_alpha)
    new, metrics = _step(objective)(state, batch)

    logits = jax.jit(_logits)(params, biases, batch)
    loss, margin, accuracy, pairs, grad_logits = _numpy_dpo(
        logits, jax.jit(_logits)(ref_params, ref_biases, batch), batch, 0.5, 0.1, rpo_alpha)
    assert pairs >= B and 0 < accuracy < 1
    np.testing.assert_allclose(metrics["loss"], loss, rtol=1e-5)
    np.testing.assert_allclose(metrics["reward_margin"], margin, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(metrics["reward_accuracy"], accuracy)
    assert int(metrics["pairs"]) == pairs

    _, vjp = jax.vjp(lambda p: _logits(p, biases, batch), params)
    (expected,) = vjp(jnp.asarray(grad_logits, jnp.float32))
    got = jax.tree.map(lambda before, after: before - after, params, new.params)  # SGD(1): -grad
    for (path, g), e in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(expected)):
        np.testing.assert_allclose(g, e, atol=2e-6, rtol=2e-3, err_msg=jax.tree_util.keystr(path))
    assert max(float(jnp.abs(e).max()) for e in jax.tree.leaves(expected)) > 1e-3

    # two micro-batches: sums and pair counts accumulate, then one division (the same step)
    two, metrics2 = _step(objective, microbatches=2)(state, batch)
    np.testing.assert_allclose(metrics2["loss"], metrics["loss"], rtol=1e-6)
    for a, b in zip(jax.tree.leaves(two.params), jax.tree.leaves(new.params)):
        np.testing.assert_allclose(a, b, atol=1e-6)
    np.testing.assert_array_equal(new.reference["biases"], ref_biases)  # frozen while the biases move
    assert np.abs(np.asarray(new.biases - biases)).max() > 0


# -- the Trainer ------------------------------------------------------------------------------------

def _objective_config(objective, mesh, steps=3, **train):
    config = _config("muon", mesh, steps)
    config.train.update(objective=objective, **train)
    return config


def _one_device_states(config, steps):
    """The state after `steps` pure train steps on jax.devices()[0], from _initial_model()."""
    s = settings_from_config(config)
    tx, controller = make_optimizer(s.optimizer, s.train.steps), balancing.make_controller(s.balancing)
    objective = make_objective(s)
    step = jax.jit(functools.partial(
        train_step, parts=ModelParts(_initial_model()), tx=tx, controller=controller,
        lr_schedule=schedule(s.optimizer, s.train.steps, s.optimizer.learning_rate), microbatches=1,
        loss_chunk=s.train.loss_chunk_size, balance=True, include_skip=False, mesh=None, objective=objective),
        static_argnames="rope_theta")
    device = jax.devices()[0]
    state = jax.device_put(initial_state(*ModelParts.arrays(_initial_model()), tx, controller, s.train.seed,
                                         with_reference=objective.needs_reference), device)
    data = open_training_data(config, s)
    for _ in range(steps):
        state, _ = step(state, jax.device_put(next(data), device), rope_theta=data.phase.rope_theta)
    return jax.device_get(state)


@pytest.mark.parametrize("objective", ["sft", "dpo"])
def test_a_sharded_mesh_equals_one_device(tmp_path, objective):
    config = _objective_config(objective, "data=2,fsdp=2,expert=2")
    reference = _one_device_states(config, 3)
    trainer = Trainer(config, str(tmp_path), init_model=_initial_model())
    try:
        state = trainer.run()
        if objective == "dpo":
            assert jax.tree.leaves(trainer.shardings.reference) == jax.tree.leaves(
                {"params": trainer.shardings.params, "biases": trainer.shardings.biases})
            for a, b in zip(jax.tree.leaves(jax.device_get(state.reference)), jax.tree.leaves(reference.reference)):
                np.testing.assert_array_equal(a, b)
        assert_states_close(state, reference)
    finally:
        trainer.close()


def _source_checkpoint(path, seed=7, **model):
    """A model-only checkpoint of configs/tiny.py's model (fields overridden by `model`)."""
    config = load_config_file("configs/tiny.py")
    config.model.update(model)
    params, biases = ModelParts.arrays(create_model(model_config(config), seed=seed))
    save_model(str(path), params, biases, config_json(config))
    return config


def test_init_from_checkpoint_starts_from_its_weights_with_a_fresh_optimizer(tmp_path):
    _source_checkpoint(tmp_path / "source")
    config = _objective_config("dpo", "data=8", init_from_checkpoint=str(tmp_path / "source"))
    trainer = Trainer(config, str(tmp_path / "run"))
    try:
        source, _ = load_checkpoint_model(str(tmp_path / "source"))
        probe = jnp.asarray([[2, 17, 300, 41, 5, 9, 77, 3]])
        state = trainer.state
        started = trainer.parts.merge(jax.device_get(state.params), jax.device_get(state.biases))
        np.testing.assert_array_equal(started(probe), source(probe))
        np.testing.assert_array_equal(trainer.parts.merge(*jax.device_get(
            (state.reference["params"], state.reference["biases"])))(probe), source(probe))
        assert int(state.step) == 0
        fresh = trainer.tx.init(jax.device_get(state.params))
        for a, b in zip(jax.tree.leaves(jax.device_get(state.opt_state)), jax.tree.leaves(fresh)):
            np.testing.assert_array_equal(a, b)
    finally:
        trainer.close()


def _refuse_to_initialise(monkeypatch):
    monkeypatch.setattr(Trainer, "_initial_state", lambda self: pytest.fail("reached model initialisation"))


@pytest.mark.parametrize("train,message", [
    ({"objective": "ppo"}, "train.objective='ppo' does not exist"),
    ({"init_from_hf": "/x", "init_from_checkpoint": "/y"}, "both set: give one starting point"),
    ({"init_from_checkpoint": "/nonexistent/run"}, "no checkpoint at /nonexistent/run"),
])
def test_bad_objective_settings_are_named(tmp_path, monkeypatch, train, message):
    _refuse_to_initialise(monkeypatch)
    config = _objective_config("lm", "data=8")
    config.train.update(train)
    with pytest.raises(UserError, match=message):
        Trainer(config, str(tmp_path))


def test_dpo_label_smoothing_and_rpo_alpha_are_checked():
    config = _objective_config("dpo", "data=8")
    config.dpo.rpo_alpha = -1.0
    with pytest.raises(ConfigError, match=r"dpo.rpo_alpha must be >= 0"):
        settings_from_config(config)
    config.dpo.rpo_alpha = 0.0
    config.dpo.label_smoothing = 0.5
    with pytest.raises(ConfigError, match=r"dpo.label_smoothing must lie in \[0, 0.5\)"):
        settings_from_config(config)


@pytest.mark.parametrize("model,message", [
    ({"vocab_size": 256}, "model.vocab_size=256 but the config says 512"),
    ({"rope_theta": 1e5}, "trained with rope_theta=100000 but this run starts with 10000: "
                          "set --config.model.rope_theta=100000"),
])
def test_init_from_checkpoint_of_another_model_is_named(tmp_path, monkeypatch, model, message):
    _refuse_to_initialise(monkeypatch)
    _source_checkpoint(tmp_path / "source", **model)
    config = _objective_config("sft", "data=8", init_from_checkpoint=str(tmp_path / "source"))
    with pytest.raises(ConfigError, match=f"train.init_from_checkpoint: .*{message}"):
        Trainer(config, str(tmp_path / "run"))


TOKENIZER = {"sha256": "synthetic", "vocab_size": 512, "bos_id": 2, "eos_id": 1, "pad_id": 0}


def _pipeline_config(tmp_path, objective, kind, documents, steps=2):
    """_objective_config on one prepared source of `kind` (prepare.write_tokenized), seq_len 64, batch 8."""
    prepare.write_tokenized(str(tmp_path / "web"), documents, tokenizer_info=TOKENIZER, kind=kind)
    config = _objective_config(objective, "data=8", data="pipeline", steps=steps)
    config.data = ml_collections.ConfigDict(dict(
        sources={"web": str(tmp_path / "web")}, tokenizer="unused", pad_id=0, heldout_fraction=0.05,
        packing_bins=4, worker_count=0, worker_buffer_size=1, prefetch_buffer_size=2,
        phases=(dict(name="one", token_budget=8 * 64 * steps, seq_len=64, rope_theta=1e4, global_batch_size=8,
                     weights={"web": 1.0}),),
        eval=dict(seq_len=64, batch_size=8, max_batches=1)))
    return config


def test_objective_and_source_kind_must_match(tmp_path, monkeypatch):
    """sft on a text source (the kind a manifest without "kind" has) is refused, naming the sources."""
    _refuse_to_initialise(monkeypatch)
    config = _pipeline_config(tmp_path, "sft", "text", [np.arange(3, 3 + n) for n in range(20, 60)])
    with pytest.raises(ConfigError, match=r"train.objective='sft' reads chat data, but data.sources \(web\) hold text "
                                          r"documents: prepare them with python -m zaya_jax.data.prepare --kind chat, "
                                          r"or set --config.train.objective=lm"):
        Trainer(config, str(tmp_path / "run"))


def test_dpo_trains_on_prepared_preference_rows(tmp_path):
    """The pipeline's DPO rows (i18-pipe) feed the step: every packed pair counts once."""
    rng = np.random.default_rng(0)
    documents = [(np.r_[2, rng.integers(3, 512, n)], rng.integers(3, 512, 4), rng.integers(3, 512, 6))
                 for n in rng.integers(3, 12, 80)]
    config = _pipeline_config(tmp_path, "dpo", "preference", documents)
    config.eval.every_steps = 2  # held-out pairs: the DPO loss and rewards
    records = []
    trainer = Trainer(config, str(tmp_path / "run"), init_model=_initial_model(), on_log=records.append)
    try:
        trainer.run()
    finally:
        trainer.close()
    from zaya_jax.data import build_pipeline
    pipeline = build_pipeline(config.data, seed=config.train.seed)
    train = [r for r in records if r["kind"] == "train"]
    for record in train:
        batch = next(pipeline)
        packed = sum(len(set(row[row > 0])) for row in batch["segment_ids"]) // 2  # two segments per pair
        assert packed > 0 and record["pairs"] == packed
    assert [r["step"] for r in train] == [1, 2]
    pipeline.close()
    (evaluation,) = [r for r in records if r["kind"] == "eval"]
    assert evaluation["eval/web/loss"] > 0 and 0 <= evaluation["eval/web/reward_accuracy"] <= 1
    assert evaluation["eval/web/reward_margin"] == pytest.approx(
        evaluation["eval/web/chosen_reward"] - evaluation["eval/web/rejected_reward"], abs=1e-6)


def test_planner_counts_the_reference_model_of_dpo():
    cfg = model_config(load_config_file("configs/tiny.py"))
    mesh = {"data": 2, "fsdp": 2}
    lm = plan(cfg, mesh, StepShape(global_batch=8, seq_len=64))
    dpo = plan(cfg, mesh, StepShape(global_batch=8, seq_len=64, objective="dpo"))["bytes_per_device"]
    assert "reference_model" not in lm["bytes_per_device"]
    assert dpo["reference_model"] == dpo["params"] > 0
    # the lm step's fused loss head holds an fp32 gradient of the embedding instead
    head = lm["bytes_per_device"]["loss_head_weight_grad"]
    assert "loss_head_weight_grad" not in dpo and head == cfg.vocab_size * cfg.hidden_size * 4 / 2  # fsdp=2
    assert dpo["total"] == pytest.approx(lm["bytes_per_device"]["total"] - head + dpo["params"])


RESUME_RUN = ("--config.optimizer.warmup_steps=1", "--config.train.steps=6", "--config.train.log_every_steps=1",
              "--config.checkpoint.every_steps=3", "--config.eval.every_steps=0",
              "--config.monitor.heatmap_every_steps=0", "--config.monitor.tensorboard=False")
LOGGED = ("loss", "grad_norm", "lr", "reward_margin", "reward_accuracy", "chosen_reward", "rejected_reward", "pairs")


def _train_records(workdir) -> dict[int, dict]:
    """{step: the objective's logged metrics}; a step logged again after a restart keeps its last record."""
    from zaya_jax.train.monitor import read_metrics
    return {r["step"]: {k: r[k] for k in LOGGED if k in r} for r in read_metrics(str(workdir / "metrics.jsonl"))}


@pytest.mark.parametrize("objective", ["sft", "dpo", "lm-fp8"])
def test_resume_after_sigkill_is_bit_exact(tmp_path, objective):
    """Killed (SIGKILL) after step 4 with checkpoint 3 on disk, restarted: every logged metric equals
    an uninterrupted run's. The DPO run starts from another run's checkpoint, which trains on
    between the kill and the restart: the restart takes its reference model from its own checkpoint.
    lm-fp8 trains with model.matmul_precision=fp8: its per-tensor scales are recomputed from each
    step's operands (current scaling), so the weights and the batch position are all a resume needs."""
    from tests.train_helpers import run_train
    objective, _, precision = objective.partition("-")
    overrides = (*RESUME_RUN, f"--config.train.objective={objective}",
                 f"--config.model.matmul_precision={precision or 'default'}")
    source = tmp_path / "source"
    if objective == "dpo":
        made = run_train(source, *RESUME_RUN, "--config.train.steps=2")
        assert made.returncode == 0, made.stderr[-3000:]
        overrides += (f"--config.train.init_from_checkpoint={source}", "--config.eval.every_steps=6")
    reference = run_train(tmp_path / "ref", *overrides)
    assert reference.returncode == 0, reference.stderr[-3000:]
    expected = _train_records(tmp_path / "ref")
    assert sorted(expected) == list(range(1, 7))
    if objective == "dpo":
        assert "train.init_from_checkpoint" in reference.stdout + reference.stderr
        assert all(r["pairs"] > 0 for r in expected.values())
        assert len({r["reward_margin"] for r in expected.values()}) > 1

    killed = run_train(tmp_path / "run", *overrides, faults={"KILL_AT_STEP": 4, "KILL_SIGNAL": "SIGKILL"})
    assert killed.returncode == -9, killed.stderr[-3000:]
    if objective == "dpo":
        moved = run_train(source, *RESUME_RUN, "--config.train.steps=3")  # the source's newest step is now 3
        assert moved.returncode == 0 and "restored checkpoint 2" in moved.stdout + moved.stderr
    finished = run_train(tmp_path / "run", *overrides)
    assert finished.returncode == 0 and "start at step 3: restored checkpoint 3" in finished.stdout + finished.stderr
    assert _train_records(tmp_path / "run") == expected
    if precision:  # the restarted run kept the recipe (its checkpoint's config records it)
        from zaya_jax.checkpoints.orbax_checkpoint import read_config
        assert read_config(str(tmp_path / "run" / "checkpoints")).model.matmul_precision == precision
    if objective == "dpo":  # the evaluate CLI scores the checkpoint against its saved reference model
        from tests.train_helpers import REPO, cli_env
        from zaya_jax.train.monitor import read_metrics
        done = subprocess.run([sys.executable, "-m", "zaya_jax.evaluate", "--checkpoint", str(tmp_path / "run")],
                              cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        scored = json.loads(done.stdout)["results"]["synthetic"]
        (trained,) = read_metrics(str(tmp_path / "run" / "metrics.jsonl"), kind="eval")
        assert trained["step"] == 6 and scored["pairs"] > 0
        for key in ("loss", "reward_accuracy", "reward_margin", "chosen_reward", "rejected_reward"):
            assert scored[key] == pytest.approx(trained[f"eval/synthetic/{key}"], rel=1e-5, abs=1e-7), key


def test_the_reference_item_is_checksummed_and_required_by_a_dpo_resume(tmp_path):
    """A damaged `reference` item makes a DPO resume fall back to the step before; a DPO restore of a
    step saved without one (an lm / sft run) is refused by name."""
    from tests.train_helpers import flip_bytes_of_item
    from zaya_jax.train.checkpoint import Checkpointer
    from zaya_jax.train.data import SyntheticIterator, synthetic_phase
    from zaya_jax.train.settings import CheckpointSettings
    s = settings_from_config(_objective_config("dpo", "data=8"))
    data = SyntheticIterator(synthetic_phase(s), s.model.vocab_size, 0, "dpo")
    tx = make_optimizer(s.optimizer, s.train.steps)
    dpo = initial_state(*ModelParts.arrays(_initial_model()), tx, CONTROLLER, 0, with_reference=True)
    settings = CheckpointSettings(async_save=False)
    checkpointer = Checkpointer(str(tmp_path / "dpo"), settings, reference=True)
    for step in (1, 2):
        checkpointer.save(dpo.replace(step=jnp.asarray(step, jnp.int32)), data, {})
    checkpointer.close()
    flip_bytes_of_item(str(tmp_path / "dpo" / "2"), "reference")
    logged = []
    assert Checkpointer(str(tmp_path / "dpo"), settings, reference=True).resume_point(logged.append) == (1, "training")
    assert "checkpoint 2 skipped (reference/" in logged[0] and "fails its checksum" in logged[0]

    lm = Checkpointer(str(tmp_path / "lm"), settings)
    lm.save(dpo.replace(reference=None), data, {})
    lm.close()
    target = jax.eval_shape(lambda: dpo)
    with pytest.raises(UserError, match="checkpoint 0 in .* has no reference model: it was not saved by a "
                                        "train.objective=dpo run"):
        Checkpointer(str(tmp_path / "lm"), settings, reference=True).restore(0, target, data)
