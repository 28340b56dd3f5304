"""`python -m zaya_jax.convert to_hf`: an export loads in transformers and computes the model it came
from, or is refused with the reason and the fix (exit 2, nothing written)."""

import dataclasses
import os
import stat
import subprocess
import sys

import numpy as np
import pytest

import zaya_jax
from tests.hf_reference import hf_logits
from tests.train_helpers import REPO, cli_env, run_train
from zaya_jax.config_files import load_config_file, model_config
from zaya_jax.model.build import create_model
from zaya_jax.checkpoints.orbax_checkpoint import load_checkpoint_model, save_model
from zaya_jax.checkpoints.model_parts import ModelParts

TINY = os.path.join(REPO, "configs", "tiny.py")
# what transformers' native schema can hold: router norm eps = rms_norm_eps, residual stream in fp32
NATIVE_FIELDS = dict(router_norm_eps=1e-5, residual_in_fp32=True)
IDS = np.random.default_rng(7).integers(3, 512, (2, 20))


def convert(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zaya_jax.convert", *map(str, args)], cwd=REPO, env=cli_env(),
                          capture_output=True, text=True, timeout=300)


def transformers_logits(directory) -> np.ndarray:
    from transformers import ZayaForCausalLM
    return hf_logits(ZayaForCausalLM.from_pretrained(directory).eval(), IDS)


@pytest.fixture(scope="module")
def native_run(tmp_path_factory):
    """A tiny native-layout model trained 3 steps by the CLI (balancing moves the expert biases)."""
    workdir = tmp_path_factory.mktemp("native") / "run"
    done = run_train(workdir, "--config.model.layout=native", "--config.model.router_norm_eps=1e-5",
                     "--config.model.residual_in_fp32=True", "--config.train.steps=3",
                     "--config.optimizer.warmup_steps=1", "--config.balancing.rate=0.05",
                     "--config.checkpoint.every_steps=0", "--config.eval.every_steps=0")
    assert done.returncode == 0, done.stderr[-3000:]
    return workdir


def saved_base_model(directory, expert_bias: float):
    """A tiny base-layout model (every other field native-compatible) saved as a model-only checkpoint,
    every real expert's balancing bias set to `expert_bias` (the skip slot's stays -1)."""
    cfg = model_config(load_config_file(TINY)).replace(layout="base", **NATIVE_FIELDS)
    model = create_model(cfg, seed=3)
    router = model.layers.moe.router
    router.balancing_biases.value = router.balancing_biases[...].at[:, :-1].set(expert_bias)
    params, biases = ModelParts.arrays(model)
    save_model(str(directory), params, biases, {"model": dataclasses.asdict(cfg)})
    return model


@pytest.mark.torch_reference
def test_trained_native_model_exports_what_transformers_loads_with_the_same_logits(native_run, tmp_path):
    source, _ = load_checkpoint_model(str(native_run))
    biases = np.asarray(source.layers.moe.router.balancing_biases[...])
    assert np.abs(biases[:, :-1]).max() > 0  # training moved the expert biases: the export carries them
    done = convert("to_hf", "--checkpoint", native_run, "--out", tmp_path / "hf")
    assert done.returncode == 0, done.stderr[-3000:]
    np.testing.assert_allclose(transformers_logits(tmp_path / "hf"), np.asarray(source(IDS)), atol=1e-4, rtol=0)
    for path in (tmp_path / "hf", *(tmp_path / "hf").iterdir()):
        assert os.stat(path).st_mode & stat.S_IRGRP, path  # readable by the group, not 0700 / 0600


def test_base_model_whose_skip_slot_is_reachable_is_refused_unless_original_is_asked_for(tmp_path):
    model = saved_base_model(tmp_path / "ckpt", expert_bias=-2.0)
    _, stats = model.forward_with_stats(IDS)
    assert int(np.asarray(stats.expert_counts)[:, -1].sum()) > 0  # tokens do take the skip slot (p * x)
    for schema in ((), ("--schema", "native")):
        refused = convert("to_hf", "--checkpoint", tmp_path / "ckpt", "--out", tmp_path / "hf", *schema)
        assert refused.returncode == 2, refused.stderr[-3000:]
        assert "skip slot" in refused.stderr and "--schema original" in refused.stderr
        assert "Traceback" not in refused.stderr and not (tmp_path / "hf").exists()
    done = convert("to_hf", "--checkpoint", tmp_path / "ckpt", "--out", tmp_path / "hf", "--schema", "original")
    assert done.returncode == 0 and "transformers' ZayaForCausalLM cannot" in done.stderr
    np.testing.assert_array_equal(np.asarray(zaya_jax.load_hf(tmp_path / "hf")(IDS)), np.asarray(model(IDS)))


@pytest.mark.torch_reference
def test_base_model_whose_skip_slot_is_unreachable_exports_as_native(tmp_path):
    model = saved_base_model(tmp_path / "ckpt", expert_bias=0.0)  # p_skip - 1 <= 0 <= p_j + 0: never skip
    done = convert("to_hf", "--checkpoint", tmp_path / "ckpt", "--out", tmp_path / "hf")
    assert done.returncode == 0, done.stderr[-3000:]
    np.testing.assert_allclose(transformers_logits(tmp_path / "hf"), np.asarray(model(IDS)), atol=1e-4, rtol=0)


def test_a_field_the_native_schema_cannot_hold_is_named(tmp_path):
    cfg = model_config(load_config_file(TINY)).replace(layout="native", residual_in_fp32=True)
    assert cfg.router_norm_eps != cfg.rms_norm_eps  # transformers uses one eps for both norms
    params, biases = ModelParts.arrays(create_model(cfg, seed=0))
    save_model(str(tmp_path / "ckpt"), params, biases, {"model": dataclasses.asdict(cfg)})
    refused = convert("to_hf", "--checkpoint", tmp_path / "ckpt", "--out", tmp_path / "hf")
    assert refused.returncode == 2 and "model.router_norm_eps=1e-06 reads back as 1e-05" in refused.stderr
    assert "--config.model.router_norm_eps=1e-05" in refused.stderr and not (tmp_path / "hf").exists()


def test_missing_checkpoint_is_named_and_not_created(tmp_path):
    refused = convert("to_hf", "--checkpoint", tmp_path / "nope", "--out", tmp_path / "hf")
    assert refused.returncode == 2 and f"no checkpoint at {tmp_path / 'nope'}" in refused.stderr
    assert not (tmp_path / "nope").exists()
    assert len(refused.stderr.strip().splitlines()) == 1
