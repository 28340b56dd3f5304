"""Zyphra's original ZAYA1-base checkpoint layout, from a fixture written by hand (not by our saver).

The fixture takes a random HF transformers model and rewrites its tensors under the names,
shapes and fused order that zaya1-spec (sections 1.3, 2.2, 2.4) and Zyphra's public converter
(`convert_zaya_weights_to_hf.py`, original <-> native) give: sub-layers 2i (CCA) and 2i+1 (MoE),
`self_attn.qkv.{linear_q,linear_k,val_proj1,val_proj2,conv_qk.0,conv_qk.1,temp}`,
`zaya_block.router.{down_proj,router_states_scale,rmsnorm_eda,router_mlp.0/2/4,balancing_biases}`,
one `linear_fc1` [2I, D] per expert with the gate rows first, `linear_fc2` [D, I], and the
residual scalings one sub-layer ahead (`model.layers.0.res_scale` = input affine, the last in
`model.res_scale`). config.json carries the original schema's fields, `num_hidden_layers`
deliberately wrong (the released config says 120; `zaya_layers` decides).
"""

import json

import jax
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

import zaya_jax
from tests.hf_reference import hf_logits, jax_from_hf, make_hf_model

pytestmark = pytest.mark.torch_reference  # every test compares with PyTorch transformers

SHAPE = dict(vocab_size=83, hidden_size=28, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
             head_dim=8, num_experts=3, moe_intermediate_size=12, router_hidden_size=6, rms_norm_eps=1e-5)
IDS = np.random.default_rng(4).integers(0, SHAPE["vocab_size"], (2, 21))

_ATTENTION = {"self_attn.qkv_proj.q_proj.weight": "self_attn.qkv.linear_q.weight",
              "self_attn.qkv_proj.k_proj.weight": "self_attn.qkv.linear_k.weight",
              "self_attn.qkv_proj.v_proj_current.weight": "self_attn.qkv.val_proj1.weight",
              "self_attn.qkv_proj.v_proj_delayed.weight": "self_attn.qkv.val_proj2.weight",
              "self_attn.qkv_proj.conv_qk_depthwise.weight": "self_attn.qkv.conv_qk.0.weight",
              "self_attn.qkv_proj.conv_qk_depthwise.bias": "self_attn.qkv.conv_qk.0.bias",
              "self_attn.qkv_proj.conv_qk_grouped.weight": "self_attn.qkv.conv_qk.1.weight",
              "self_attn.qkv_proj.conv_qk_grouped.bias": "self_attn.qkv.conv_qk.1.bias",
              "self_attn.qk_norm.temp": "self_attn.qkv.temp",
              "self_attn.o_proj.weight": "self_attn.o_proj.weight",
              "input_layernorm.weight": "input_norm.weight"}
_ROUTER = {"down_proj.weight": "down_proj.weight", "down_proj.bias": "down_proj.bias",
           "router_states_scale": "router_states_scale", "router_mlp.norm.weight": "rmsnorm_eda.weight",
           "router_mlp.fc1.weight": "router_mlp.0.weight", "router_mlp.fc1.bias": "router_mlp.0.bias",
           "router_mlp.fc2.weight": "router_mlp.2.weight", "router_mlp.fc2.bias": "router_mlp.2.bias",
           "router_mlp.out_proj.weight": "router_mlp.4.weight", "balancing_biases": "balancing_biases"}


def original_tensors(native: dict[str, np.ndarray], layers: int) -> dict[str, np.ndarray]:
    """HF native state dict -> Zyphra's original ZAYA1-base names (written from the spec, not our code)."""
    out = {"model.embed_tokens.weight": native["model.embed_tokens.weight"],
           "model.final_norm.weight": native["model.norm.weight"]}
    for part in ("scale", "bias"):
        out[f"model.layers.0.res_scale.hidden_states_{part}"] = native[f"model.input_hidden_states_{part}"]
    for i in range(layers):
        src, att, moe = f"model.layers.{i}.", f"model.layers.{2 * i}.", f"model.layers.{2 * i + 1}."
        for theirs, ours in _ATTENTION.items():
            out[att + ours] = native[src + theirs]
        out[moe + "input_norm.weight"] = native[src + "post_attention_layernorm.weight"]
        for theirs, ours in _ROUTER.items():
            if src + "mlp.gate." + theirs in native:  # layer 0 has no router_states_scale
                out[moe + "zaya_block.router." + ours] = native[src + "mlp.gate." + theirs]
        after_moe = f"model.layers.{2 * i + 2}.res_scale." if i + 1 < layers else "model.res_scale."
        for part in ("hidden_states_scale", "hidden_states_bias", "residual_scale", "residual_bias"):
            out[moe + "res_scale." + part] = native[src + "post_attention_residual_scale." + part]
            out[after_moe + part] = native[src + "post_mlp_residual_scale." + part]
        gate_up, down = native[src + "mlp.experts.gate_up_proj"], native[src + "mlp.experts.down_proj"]
        for e in range(gate_up.shape[0]):
            out[f"{moe}zaya_block.experts.local_experts.{e}.linear_fc1.weight"] = gate_up[e]  # [gate; up] rows
            out[f"{moe}zaya_block.experts.local_experts.{e}.linear_fc2.weight"] = down[e]
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def original_config(hf_config) -> dict:
    c, layers = hf_config, hf_config.num_hidden_layers
    return {"model_type": "zaya", "architectures": ["ZayaForCausalLM"], "vocab_size": c.vocab_size,
            "hidden_size": c.hidden_size, "num_hidden_layers": 120, "zaya_layers": ["a", c.num_experts] * layers,
            "num_attention_heads": 2 * c.num_attention_heads, "cca_num_q_heads": c.num_attention_heads,
            "num_key_value_heads": c.num_key_value_heads, "num_query_groups_list": [c.num_key_value_heads] * layers,
            "kv_channels": c.head_dim, "ffn_hidden_size": 2 * c.moe_intermediate_size,
            "zaya_mlp_expansion": c.router_hidden_size, "rope_theta": 10_000.0, "rope_scaling": False,
            "norm_epsilon": c.rms_norm_eps, "layernorm_epsilon": c.rms_norm_eps, "residual_in_fp32": False,
            "moe_router_topk": 1, "zaya_use_mod": True, "zaya_use_eda": True, "scale_residual_merge": True,
            "add_bias_linear": False, "gated_linear_unit": True, "activation_func": "swiglu",
            "tie_word_embeddings": True, "pad_token_id": 0, "bos_token_id": 2, "eos_token_id": 1}


@pytest.fixture(scope="module")
def hf_model():
    return make_hf_model(seed=9, **SHAPE)  # skip bias -1: base and native layouts compute the same


def _write(directory, hf_model, tensors):
    directory.mkdir()
    save_file(tensors, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(original_config(hf_model.config)))
    return directory


def _native(hf_model):
    return {k: v.detach().numpy() for k, v in hf_model.state_dict().items() if k != "lm_head.weight"}


def test_hand_written_original_checkpoint_loads_every_tensor_in_place(hf_model, tmp_path):
    directory = _write(tmp_path / "zaya1_base", hf_model, original_tensors(_native(hf_model), 3))
    model = zaya_jax.load_hf(directory, moe_backend="dense")
    assert model.config.layout == "base" and model.config.num_layers == 3
    _, stats = model.forward_with_stats(IDS)
    assert int(np.asarray(stats.expert_counts)[:, -1].sum()) == 0  # the layouts differ only on skip tokens
    np.testing.assert_allclose(np.asarray(model(IDS)), hf_logits(hf_model, IDS), atol=1e-4, rtol=0)

    reference = jax_from_hf(hf_model)  # the native path, proven against torch gradients elsewhere
    ours, theirs = nnx.to_pure_dict(nnx.state(model)), nnx.to_pure_dict(nnx.state(reference))
    for (path, a), (_, b) in zip(jax.tree_util.tree_flatten_with_path(ours)[0],
                                 jax.tree_util.tree_flatten_with_path(theirs)[0]):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("mistake", ["gate_up_swapped", "gate_up_interleaved", "router_fc1_transposed",
                                     "conv_taps_reversed",
                                     "value_projections_swapped"])
def test_a_layout_mistake_in_the_fixture_changes_the_logits(hf_model, tmp_path, mistake):
    """The comparison above is sensitive: each of these misreadings would have failed it
    (a transpose of a non-square tensor is refused by the loader's shape check)."""
    tensors = original_tensors(_native(hf_model), 3)
    i_size = SHAPE["moe_intermediate_size"]
    for name in list(tensors):
        w = tensors[name]
        if mistake == "gate_up_swapped" and name.endswith("linear_fc1.weight"):
            tensors[name] = np.concatenate([w[i_size:], w[:i_size]])
        elif mistake == "gate_up_interleaved" and name.endswith("linear_fc1.weight"):
            tensors[name] = np.ascontiguousarray(w.reshape(2, i_size, -1).transpose(1, 0, 2).reshape(w.shape))
        elif mistake == "router_fc1_transposed" and name.endswith("router_mlp.0.weight"):
            tensors[name] = np.ascontiguousarray(w.T)
        elif mistake == "conv_taps_reversed" and name.endswith("conv_qk.1.weight"):
            tensors[name] = np.ascontiguousarray(w[..., ::-1])
        elif mistake == "value_projections_swapped" and name.endswith("val_proj1.weight"):
            other = name.replace("val_proj1", "val_proj2")
            tensors[name], tensors[other] = tensors[other], w
    model = zaya_jax.load_hf(_write(tmp_path / mistake, hf_model, tensors), moe_backend="dense")
    assert np.abs(np.asarray(model(IDS)) - hf_logits(hf_model, IDS)).max() > 1e-2
