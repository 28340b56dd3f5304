"""save_hf -> load_hf round trips: sharded files, Zyphra's original ZAYA1-base names."""

import json

import jax
import numpy as np
from flax import nnx

import zaya_jax
from tests.model_fixtures import tiny_model

IDS = np.random.default_rng(3).integers(3, 64, (2, 9))


def _assert_same_params(a, b):
    for x, y in zip(jax.tree.leaves(nnx.state(a)), jax.tree.leaves(nnx.state(b))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_original_base_names_round_trip(tmp_path):
    model = tiny_model()  # base layout
    zaya_jax.save_hf(model, tmp_path / "base")
    config = json.loads((tmp_path / "base" / "config.json").read_text())
    assert config["zaya_layers"] == ["a", 4, "a", 4] and config["num_hidden_layers"] == 4
    names = set(json.loads((tmp_path / "base" / "model.safetensors").read_bytes()[8:][
        :int.from_bytes((tmp_path / "base" / "model.safetensors").read_bytes()[:8], "little")]))
    assert "model.layers.1.zaya_block.experts.local_experts.3.linear_fc1.weight" in names
    assert "model.layers.3.zaya_block.router.router_states_scale" in names
    assert "model.layers.1.zaya_block.router.router_states_scale" not in names
    assert "model.res_scale.residual_bias" in names and "model.final_norm.weight" in names
    loaded = zaya_jax.load_hf(tmp_path / "base")
    assert loaded.config == model.config
    _assert_same_params(model, loaded)


def test_sharded_checkpoint_round_trip(tmp_path):
    model = tiny_model(layout="native", residual_in_fp32=True, router_norm_eps=1e-5)
    zaya_jax.save_hf(model, tmp_path / "sharded", max_shard_bytes=20_000)
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    loaded = zaya_jax.load_hf(tmp_path / "sharded")
    _assert_same_params(model, loaded)
    np.testing.assert_array_equal(np.asarray(loaded(IDS)), np.asarray(model(IDS)))


def test_load_in_bfloat16_keeps_fp32_params(tmp_path):
    model = tiny_model(layout="native", residual_in_fp32=True, router_norm_eps=1e-5)
    zaya_jax.save_hf(model, tmp_path / "ckpt")
    loaded = zaya_jax.load_hf(tmp_path / "ckpt", dtype="bfloat16", moe_backend="ragged")
    assert loaded.config.dtype == "bfloat16" and loaded.config.moe_backend == "ragged"
    assert loaded.embed[...].dtype == np.float32
    np.testing.assert_allclose(np.asarray(loaded(IDS)), np.asarray(model(IDS)), atol=0.1)
