"""K optimizer steps of the Trainer on each documented mesh layout equal the same steps on one device.

The reference is the pure train step (zaya_jax.train.step.train_step, mesh=None) jitted on a
single device, fed the same synthetic batches from the same initial weights; the Trainer runs
on 8 fake CPU devices with the layout under test. Balancing is on (its biases move and are
compared), Muon's Newton-Schulz runs on fsdp/tensor/expert-sharded matrices, ZeRO-1
(`mesh.shard_optimizer_over_data`) slices the optimizer state. The all_to_all layouts use a
capacity factor of E so nothing is dropped: every layout computes one function. A model with a
sliding-window layer (model.layer_types; window 8 in sequences of 64) trains equally on a
data x context x tensor mesh, the context axis splitting the sequence its windows run over.
Tolerance: params, biases and optimizer moments within atol 1e-5 + rtol 1e-4 after K=3 steps:
float32 reduction order differs between layouts, and AdamW divides by sqrt(v), so an element
whose gradient is near 0 may move by a few 1e-6; a sharding bug moves values by a learning-rate
step (1e-2). The data x context x tensor layout with AdamW gets atol 3e-5: on an AMD EPYC (OpenBLAS's
Zen sgemm under the native grouped matmul, whose row results depend on a group's row count) one
element in 32,768 moved 1.5e-5 there.
"""

import collections
import functools
import re

import jax
import numpy as np
import pytest

from benchmarks.planner.compiled_collectives import compiled_step
from zaya_jax.config_files import load_config_file, model_config
from zaya_jax.model.build import create_model
from zaya_jax.parallel.mesh import parse_mesh_flag
from zaya_jax.train import balancing
from zaya_jax.train.data import open_training_data
from zaya_jax.train.loop import Trainer
from zaya_jax.train.optimizer import make_optimizer, schedule
from zaya_jax.train.settings import settings_from_config
from zaya_jax.checkpoints.model_parts import ModelParts
from zaya_jax.train.state import initial_state
from zaya_jax.train.step import train_step

K = 3
SLIDING = dict(layer_types=("hybrid_sliding", "hybrid"), sliding_window=8, sliding_rope_theta=500.0)


def _config(optimizer: str, mesh: str, steps: int = K, zero1: bool = False, sliding: bool = False):
    config = load_config_file("configs/tiny.py")
    config.model.update(SLIDING if sliding else {})
    config.model.capacity_factor = float(config.model.num_experts)
    config.train.update(steps=steps, log_every_steps=1)
    # a constant schedule: the compiled step does not depend on train.steps, so a 2-step and a
    # 4-step run on one mesh share one compilation
    config.optimizer.update(name=optimizer, schedule="constant", warmup_steps=1, learning_rate=1e-2)
    config.balancing.rate = 1e-2  # large enough that the biases visibly move in K steps
    config.eval.every_steps = 0
    config.checkpoint.update(every_steps=0, async_save=False)
    config.monitor.update(progress_bar=False, tensorboard=False, heatmap_every_steps=0)
    config.mesh.update({"data": 1, **parse_mesh_flag(mesh), "shard_optimizer_over_data": zero1})
    return config


@functools.lru_cache(maxsize=None)
def _initial_model(sliding: bool = False):
    return create_model(model_config(load_config_file("configs/tiny.py")).replace(**(SLIDING if sliding else {})),
                        seed=5)


@functools.lru_cache(maxsize=None)
def one_device_states(optimizer: str, steps: int, sliding: bool = False) -> tuple:
    """The train state after each of `steps` steps, on jax.devices()[0] without a mesh."""
    config = _config(optimizer, "data=8", steps, sliding=sliding)
    s = settings_from_config(config)
    tx, controller = make_optimizer(s.optimizer, s.train.steps), balancing.make_controller(s.balancing)
    step = jax.jit(functools.partial(
        train_step, parts=ModelParts(_initial_model(sliding)), tx=tx, controller=controller,
        lr_schedule=schedule(s.optimizer, s.train.steps, s.optimizer.learning_rate), microbatches=1,
        loss_chunk=s.train.loss_chunk_size, balance=True, include_skip=s.balancing.include_skip, mesh=None),
        static_argnames="rope_theta")
    device = jax.devices()[0]
    state = jax.device_put(initial_state(*ModelParts.arrays(_initial_model(sliding)), tx, controller, s.train.seed),
                           device)
    data = open_training_data(config, s)
    states = []
    for _ in range(steps):
        state, _ = step(state, jax.device_put(next(data), device), rope_theta=data.phase.rope_theta)
        states.append(jax.device_get(state))
    return tuple(states)


def assert_states_close(state, reference, atol: float = 1e-5):
    assert int(state.step) == int(reference.step)
    for name in ("params", "biases", "opt_state", "controller_state"):
        got, want = jax.device_get(getattr(state, name)), getattr(reference, name)
        for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=atol, rtol=1e-4,
                                       err_msg=name + jax.tree_util.keystr(path))


def _train(tmp_path, config, sliding: bool = False):
    trainer = Trainer(config, str(tmp_path), init_model=_initial_model(sliding))
    try:
        trainer.run()
        return trainer.state
    finally:
        trainer.close()


# Every mesh axis appears (data, fsdp, expert, tensor, context), with and without ZeRO-1; each
# layout is one compilation on 2 CPU cores, so the set is kept to the ones that differ.
LAYOUTS = [("muon", "data=2,fsdp=2,expert=2", True), ("muon", "fsdp=2,expert=2,tensor=2", False),
           ("adamw", "data=2,context=2,tensor=2", True)]


@pytest.mark.parametrize("optimizer,mesh,zero1", LAYOUTS)
def test_k_steps_on_a_mesh_equal_one_device(tmp_path, optimizer, mesh, zero1):
    reference = one_device_states(optimizer, 4)[:K]
    initial_biases = ModelParts.arrays(_initial_model())[1]
    assert np.abs(reference[-1].biases - initial_biases).max() > 1e-4, "balancing must move the biases"
    assert_states_close(_train(tmp_path, _config(optimizer, mesh, zero1=zero1)), reference[-1],
                        atol=3e-5 if optimizer == "adamw" else 1e-5)


def test_sliding_window_model_on_a_context_mesh_equals_one_device(tmp_path):
    """AdamW (Muon's Newton-Schulz doubles the compile time): one moved element in 32,768 was seen
    1.4e-5 off (the near-zero-gradient effect above), hence atol 3e-5, still far from a step's 1e-2."""
    reference = one_device_states("adamw", K, sliding=True)
    assert_states_close(_train(tmp_path, _config("adamw", "data=2,context=2,tensor=2", sliding=True), sliding=True),
                        reference[-1], atol=3e-5)


def _newton_schulz_stacks(config) -> collections.Counter:
    """{(batch, rows, cols): n} of the batched f32 dots in the compiled step of `config`."""
    return collections.Counter(re.findall(r"= f32\[(\d+),(\d+),(\d+)\]\{[\d,]+\} dot\(", compiled_step(config)))


def test_distributed_muon_on_the_launch_layout_equals_one_device(tmp_path):
    """optimizer.muon_distributed on data=4,context=2 with ZeRO-1 (the launch's layout): K steps of
    Muon and AdamW groups with balancing on equal one device, and each rank orthogonalises its own
    share: the compiled step holds no Newton-Schulz dot over a stack (tiny's 2 x 4 experts and 2
    layers: one whole matrix per rank), where with the option off every rank runs its 8-row slice
    of all 8 expert matrices (5 iterations x 3 dots x gate, up, down)."""
    config = _config("muon", "data=4,context=2", zero1=True)
    assert _newton_schulz_stacks(config)[("8", "8", "64")] == 45
    config.optimizer.muon_distributed = True
    stacks = _newton_schulz_stacks(config)
    assert not [shape for shape in stacks if shape[0] in ("2", "8")], stacks
    assert_states_close(_train(tmp_path, config), one_device_states("muon", 4)[K - 1])


def test_reshaped_restore_with_nonzero_moments_continues_like_one_device(tmp_path):
    """Save after 2 steps on data=2,fsdp=2,expert=2 with ZeRO-1, restore on fsdp=2,expert=2,tensor=2
    without it, take 2 more steps: equals 4 straight steps on one device."""
    reference = one_device_states("muon", 4)
    saved = _train(tmp_path, _config("muon", LAYOUTS[0][1], steps=2, zero1=True))
    moments = [np.abs(np.asarray(x)).max() for x in jax.tree.leaves(jax.device_get(saved.opt_state))
               if np.ndim(x) > 0]
    assert min(moments) > 0, "every optimizer moment is non-zero at the save"
    assert_states_close(saved, reference[1])

    resumed = Trainer(_config("muon", LAYOUTS[1][1], steps=4), str(tmp_path))
    try:
        assert int(resumed.state.step) == 2
        assert_states_close(resumed.state, reference[1])  # the restore itself, resharded
        resumed.run()
        assert_states_close(resumed.state, reference[3])
    finally:
        resumed.close()
