"""Checkpoint reshaping (save on one mesh, restore on another) and rollback after non-finite steps."""

import jax
import jax.numpy as jnp
import numpy as np

from zaya_jax.config_files import load_config_file
from zaya_jax.train.data import synthetic_batch
from zaya_jax.train.loss import token_nll
from zaya_jax.train.loop import Trainer
from zaya_jax.train.monitor import read_metrics


def _config(steps: int, **mesh):
    config = load_config_file("configs/tiny.py")
    config.train.steps, config.train.log_every_steps = steps, 1
    config.optimizer.name, config.optimizer.warmup_steps = "adamw", 1  # AdamW compiles faster than Muon
    config.checkpoint.every_steps = 2
    config.eval.every_steps = 0
    config.monitor.progress_bar, config.monitor.tensorboard, config.monitor.heatmap_every_steps = False, False, 0
    config.mesh.update(mesh)
    return config


def test_restore_onto_another_mesh(tmp_path):
    """Saved on data=8 with the optimizer state sharded over data (ZeRO-1); resumed on fsdp=4 x tensor=2."""
    source = Trainer(_config(2, data=8, shard_optimizer_over_data=True), str(tmp_path))
    gate_mu = [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(source.state.opt_state)
               if "'gate'" in jax.tree_util.keystr(path) and leaf.ndim == 4][0]
    assert "data" in str(gate_mu.sharding.spec)
    source.save()
    source.close()

    target = Trainer(_config(2, data=1, fsdp=4, tensor=2), str(tmp_path))
    assert target.state.params["layers"]["attention"]["q_proj"].sharding.spec == jax.P(None, "fsdp", "tensor", None)
    assert target.state.params["layers"]["moe"]["gate"].sharding.spec == jax.P(None, None, "fsdp", "tensor")
    for a, b in zip(jax.tree.leaves(target.state), jax.tree.leaves(source.state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    target.run()  # and it trains on: the first step's loss is the restored model's loss on batch 0
    target.close()
    batch = synthetic_batch(0, 0, 8, 64, 512, slice(None))
    model = target.parts.merge(source.state.params, source.state.biases)
    logits = jax.jit(lambda b: model(b["inputs"], segment_ids=b["segment_ids"], positions=b["positions"]))(batch)
    expected = np.sum(token_nll(logits, batch["targets"]) * batch["loss_mask"]) / np.sum(batch["loss_mask"])
    np.testing.assert_allclose(read_metrics(str(tmp_path / "metrics.jsonl"))[0]["loss"], expected, rtol=1e-5)


class PoisonedTrainer(Trainer):
    """Turns the parameters into NaN after step 3 (once): steps 4 and 5 are non-finite."""

    poisoned = False

    def _after_step(self, step):
        if step == 3 and not self.poisoned:
            self.poisoned = True
            self.state = self.state.replace(params=jax.tree.map(lambda x: x * jnp.nan, self.state.params))


def test_repeated_nonfinite_steps_roll_back_to_the_last_checkpoint(tmp_path):
    config = _config(6)
    config.train.max_nonfinite_streak = 2
    trainer = PoisonedTrainer(config, str(tmp_path))
    trainer.run()
    trainer.close()
    records = read_metrics(str(tmp_path / "metrics.jsonl"), kind="rollback")
    assert records == [{"kind": "rollback", "step": 5, "restored_step": 2, "nonfinite_streak": 2}]
    train = read_metrics(str(tmp_path / "metrics.jsonl"))
    # the logged rate is the applied one: the schedule at the count of updates applied before each step
    # (steps 3-6 as logged after the rollback to checkpoint 2: 2 to 5 updates applied before them)
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6]
    np.testing.assert_allclose([r["lr"] for r in train], [float(trainer.lr_schedule(n)) for n in range(6)], rtol=1e-6)
    assert train[-1]["step"] == 6 and np.isfinite(train[-1]["loss"]) and train[-1]["skipped_steps"] == 2
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(trainer.state.params))
    assert trainer.checkpointer.latest_step() == 6  # the poisoned state (step 4) was never saved
