"""A checkpoint written by a sharded 8-device training run loads in a 1-device process: generate,
evaluate and the Python loaders restore onto the devices they have, not the mesh that saved it."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

import zaya_jax
from tests.fake_devices import xla_flags
from tests.train_helpers import REPO, cli_env, run_train
from zaya_jax.infer import load_checkpoint
from zaya_jax.checkpoints.model_parts import ModelParts

PROMPT = [5, 6, 7]
NEW_TOKENS = 6

# Run in the 1-device process: the weights through both loaders (load_checkpoint with the default
# target, restore_model with a target that has no shardings) saved to an .npz for the test to compare.
LOAD_ONE_DEVICE = r"""
import sys
import jax
import numpy as np
from zaya_jax.infer import load_checkpoint
from zaya_jax.model.build import abstract_model
from zaya_jax.checkpoints.orbax_checkpoint import checkpoint_dir, restore_model
from zaya_jax.checkpoints.model_parts import ModelParts

assert jax.device_count() == 1, jax.devices()
workdir, out = sys.argv[1:]
model = load_checkpoint(workdir)
params, biases = ModelParts.arrays(model)
bare = dict(zip(("params", "biases"), ModelParts.arrays(abstract_model(model.config))))
restored, _ = restore_model(checkpoint_dir(workdir), bare)
arrays = {}
for prefix, tree in (("loaded", {"params": params, "biases": biases}), ("bare", restored)):
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        assert leaf.sharding.device_set == {jax.devices()[0]}
        arrays[prefix + jax.tree_util.keystr(path)] = np.asarray(leaf)
np.savez(out, **arrays)
"""


def _one_device_env() -> dict[str, str]:
    return {**cli_env(), "XLA_FLAGS": xla_flags(1)}


def _run_one_device(*command) -> str:
    result = subprocess.run([sys.executable, *map(str, command)], cwd=REPO, env=_one_device_env(),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@pytest.fixture(scope="module")
def run8(tmp_path_factory):
    """Two steps of configs/tiny.py on 8 fake devices, data=2 x fsdp=4; checkpoint and eval at step 2."""
    workdir = tmp_path_factory.mktemp("topology") / "run"
    result = run_train(workdir, "--config.mesh.data=2", "--config.mesh.fsdp=4", "--config.train.steps=2",
                       "--config.optimizer.warmup_steps=1", "--config.eval.every_steps=2",
                       "--config.eval.max_batches=1", "--config.checkpoint.every_steps=2",
                       "--config.monitor.tensorboard=False", "--config.monitor.heatmap_every_steps=100")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "mesh {'data': 2, 'fsdp': 4" in result.stderr + result.stdout
    assert os.listdir(workdir / "checkpoints") == ["2"]
    return workdir


def test_weights_restore_bit_identical_on_one_device(run8, tmp_path):
    _run_one_device("-c", LOAD_ONE_DEVICE, run8, tmp_path / "weights.npz")
    one_device = np.load(tmp_path / "weights.npz")
    params, biases = ModelParts.arrays(load_checkpoint(run8))  # this process: 8 devices
    expected = {jax.tree_util.keystr(p): np.asarray(v)
                for p, v in jax.tree_util.tree_leaves_with_path({"params": params, "biases": biases})}
    assert len(expected) > 10
    for prefix in ("loaded", "bare"):
        assert {k for k in one_device if k.startswith(prefix)} == {prefix + k for k in expected}
        for key, value in expected.items():
            np.testing.assert_array_equal(one_device[prefix + key], value, err_msg=prefix + key)


def test_generate_on_one_device_matches_the_eight_device_process(run8):
    out = _run_one_device("-m", "zaya_jax.generate", "--checkpoint", run8, "--prompt-ids",
                          ",".join(map(str, PROMPT)), "--max-new-tokens", NEW_TOKENS, "--ignore-eos")
    model = load_checkpoint(run8)  # this process: 8 devices
    expected = zaya_jax.infer.generate_static(model, [PROMPT], NEW_TOKENS, stop_at_eos=False,
                                       on_token=lambda *_: None)[0].tolist()
    assert [int(x) for x in out.split()] == expected


def test_evaluate_on_one_device_matches_the_training_runs_eval(run8):
    scored = json.loads(_run_one_device("-m", "zaya_jax.evaluate", "--checkpoint", run8))
    assert scored["step"] == 2
    records = [json.loads(line) for line in open(run8 / "metrics.jsonl")]
    (trained,) = [r for r in records if r["kind"] == "eval" and r["step"] == 2]  # on the 8-device mesh
    assert scored["results"]["synthetic"]["loss"] == pytest.approx(trained["eval/synthetic/loss"], rel=1e-6)
