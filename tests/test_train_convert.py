"""python -m zaya_jax.convert (HF -> Orbax -> HF round trip) and python -m zaya_jax.evaluate on both forms."""

import json
import os
import subprocess
import sys

import numpy as np
from safetensors.numpy import load_file

import zaya_jax
from tests.train_helpers import REPO, cli_env
from zaya_jax.config_files import load_config_file, model_config
from zaya_jax.model.build import create_model
from zaya_jax.checkpoints.orbax_checkpoint import load_checkpoint_model

TINY = os.path.join(REPO, "configs", "tiny.py")


def _cli(module, *args) -> str:
    result = subprocess.run([sys.executable, "-m", module, *map(str, args)], cwd=REPO, env=cli_env(),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_hf_to_orbax_to_hf_round_trip_and_evaluation(tmp_path):
    model = create_model(model_config(load_config_file(TINY)), seed=1)
    zaya_jax.save_hf(model, tmp_path / "hf")
    _cli("zaya_jax.convert", "to_orbax", "--hf", tmp_path / "hf", "--out", tmp_path / "orbax")
    assert os.listdir(tmp_path / "orbax") == ["0"]

    restored, step = load_checkpoint_model(str(tmp_path / "orbax"))
    assert step == 0 and restored.config == model.config
    ids = np.random.default_rng(5).integers(3, 512, (2, 12))
    np.testing.assert_array_equal(np.asarray(restored(ids)), np.asarray(model(ids)))

    _cli("zaya_jax.convert", "to_hf", "--checkpoint", tmp_path / "orbax", "--out", tmp_path / "hf2",
         "--schema", "original")  # the base layout's own names (tiny's router eps has no native field)
    assert json.loads((tmp_path / "hf2" / "config.json").read_text()) == json.loads(
        (tmp_path / "hf" / "config.json").read_text())
    before, after = load_file(tmp_path / "hf" / "model.safetensors"), load_file(tmp_path / "hf2" / "model.safetensors")
    assert before.keys() == after.keys()
    for name in before:
        np.testing.assert_array_equal(after[name], before[name], err_msg=name)

    scored = [json.loads(_cli("zaya_jax.evaluate", *source, "--config", TINY, "--config.eval.max_batches=1"))
              for source in (("--checkpoint", tmp_path / "orbax"), ("--hf", tmp_path / "hf"))]
    assert scored[0]["results"] == scored[1]["results"]
    assert scored[0]["results"]["synthetic"]["loss"] > 5  # about ln(512) for an untrained model
