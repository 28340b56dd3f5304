"""Bad configs and bad checkpoints fail early with errors that name the problem."""

import json
import re

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import zaya_jax
from tests.model_fixtures import TINY, tiny_model
from zaya_jax.config import ModelConfig
from zaya_jax.config_files import load_config_file, model_config

CONFIGS = ["configs/zaya1_base.py", "configs/zaya1_8b.py", "configs/tiny.py", "configs/bench_small.py"]


@pytest.mark.parametrize("path", CONFIGS)
def test_shipped_configs_are_valid(path):
    model_config(load_config_file(path))


def test_bench_small_has_the_documented_shape():
    config = load_config_file("configs/bench_small.py")
    cfg = model_config(config)
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.num_experts, cfg.moe_intermediate_size, cfg.router_hidden_size) == (4096, 512, 4, 8, 2, 32, 16,
                                                                                     512, 64)
    assert (config.train.seq_len, config.train.global_batch_size) == (256, 8)


@pytest.mark.parametrize("changes,field", [
    (dict(num_q_heads=6, num_kv_heads=4), "model.num_q_heads"),
    (dict(num_kv_heads=3, num_q_heads=9), "model.num_kv_heads"),
    (dict(layout="zaya2"), "model.layout"),
    (dict(moe_backend="magic"), "model.moe_backend"),
    (dict(dtype="float16"), "model.dtype"),
    (dict(hidden_size=0), "model.hidden_size"),
    (dict(eos_token_id=10_000), "model.eos_token_id"),
    (dict(partial_rotary_factor=0.3, head_dim=10), "model.partial_rotary_factor"),
])
def test_invalid_model_fields_are_named(changes, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        TINY.replace(**changes)


def test_unknown_field_and_kernel_are_named():
    with pytest.raises(ValueError, match="model.num_heads: unknown field"):
        ModelConfig.from_config({"num_heads": 4})
    config = load_config_file("configs/tiny.py")
    config.kernels.attention = "cuda"
    with pytest.raises(ValueError, match="model.attention_kernel"):
        model_config(config)


def test_missing_config_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.py"):
        load_config_file(tmp_path / "nope.py")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "native"
    zaya_jax.save_hf(tiny_model(layout="native", residual_in_fp32=True, router_norm_eps=1e-5), path)
    return path


def _copy(saved, tmp_path):
    target = tmp_path / "copy"
    target.mkdir()
    for f in saved.iterdir():
        (target / f.name).write_bytes(f.read_bytes())
    return target


def test_missing_tensor_is_named(saved, tmp_path):
    path = _copy(saved, tmp_path)
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.gate.router_states_scale"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="missing tensor 'model.layers.1.mlp.gate.router_states_scale'"):
        zaya_jax.load_hf(path)


def test_wrong_shape_and_unknown_tensor_are_named(saved, tmp_path):
    path = _copy(saved, tmp_path)
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.0.self_attn.qk_norm.temp"] = np.ones(3, np.float32)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"'model.layers.0.self_attn.qk_norm.temp' has shape \(3,\)"):
        zaya_jax.load_hf(path)
    tensors["model.layers.0.self_attn.qk_norm.temp"] = np.ones(2, np.float32)
    tensors["model.layers.0.extra.weight"] = np.ones(2, np.float32)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="unexpected tensor 'model.layers.0.extra.weight'"):
        zaya_jax.load_hf(path)


@pytest.mark.parametrize("edit,message", [
    (lambda c: c.update(model_type="llama"), "model_type is 'llama'"),
    (lambda c: c.pop("hidden_size"), "missing required key 'hidden_size'"),
    (lambda c: c.update(num_experts_per_tok=2), "num_experts_per_tok=2 is not supported"),
])
def test_bad_config_json_is_named(saved, tmp_path, edit, message):
    path = _copy(saved, tmp_path)
    config = json.loads((path / "config.json").read_text())
    edit(config)
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=re.escape(message)):
        zaya_jax.load_hf(path)


def test_missing_directory_contents_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        zaya_jax.load_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "zaya"}))
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        zaya_jax.load_hf(tmp_path)


def test_save_refuses_to_overwrite(saved):
    with pytest.raises(FileExistsError, match="not empty"):
        zaya_jax.save_hf(tiny_model(), saved)
