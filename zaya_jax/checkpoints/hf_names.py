"""Where every zaya_jax parameter lives in an HF ZAYA checkpoint, and how it is laid out there.

Two naming schemes:
  "native"    HF transformers `ZayaForCausalLM` (ZAYA1-8B): `model.layers.{i}` = CCA + MoE.
  "original"  Zyphra's ZAYA1-base checkpoint: 2L alternating sub-layers, CCA at `model.layers.{2i}`,
              MoE at `model.layers.{2i+1}`, one residual scaling per sub-layer (zaya1-spec 2.3/2.4).
Our stacked parameters have a leading layer axis (and experts an expert axis after it); an
`Entry` says which slice (`index`) of which of our arrays one HF tensor fills.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from zaya_jax.config import ModelConfig

Path = tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Entry:
    hf_name: str
    hf_shape: tuple[int, ...]
    targets: tuple[tuple[Path, tuple[int, ...]], ...]   # (our param path, index into it)
    from_hf: Callable[[np.ndarray], tuple[np.ndarray, ...]]
    to_hf: Callable[..., np.ndarray]


def _same(x):
    return (x,)


def _ident(x):
    return x


def _linear(out_dims: tuple[int, ...]):
    """torch Linear weight [out, in] <-> ours [in, *out_dims]."""
    def from_hf(w):
        return (w.T.reshape(w.shape[1], *out_dims),)

    def to_hf(x):
        return x.reshape(x.shape[0], -1).T
    return from_hf, to_hf


def _linear_in(in_dims: tuple[int, ...]):
    """torch Linear weight [out, in] <-> ours [*in_dims, out] (output projections)."""
    def from_hf(w):
        return (w.T.reshape(*in_dims, w.shape[0]),)

    def to_hf(x):
        return x.reshape(-1, x.shape[-1]).T
    return from_hf, to_hf


class _Builder:
    def __init__(self):
        self.entries: list[Entry] = []

    def add(self, hf_name, hf_shape, path, index=(), conv=(_same, _ident)):
        self.add_multi(hf_name, hf_shape, ((path, index),), *conv)

    def add_multi(self, hf_name, hf_shape, targets, from_hf, to_hf):
        self.entries.append(Entry(hf_name, tuple(hf_shape), tuple(targets), from_hf, to_hf))


def _cca_entries(b: _Builder, cfg: ModelConfig, i: int, prefix: str, names: dict[str, str]) -> None:
    d, n, k, h = cfg.hidden_size, cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim
    c = n + k
    att = ("layers", "attention")
    b.add(prefix + names["q"], (n * h, d), att + ("q_proj",), (i,), _linear((n, h)))
    b.add(prefix + names["k"], (k * h, d), att + ("k_proj",), (i,), _linear((k, h)))
    b.add(prefix + names["v_cur"], (k // 2 * h, d), att + ("v_proj_current",), (i,), _linear((k // 2, h)))
    b.add(prefix + names["v_del"], (k // 2 * h, d), att + ("v_proj_delayed",), (i,), _linear((k // 2, h)))
    b.add(prefix + names["conv0"] + ".weight", (c * h, 1, 2), att + ("conv_depthwise_weight",), (i,),
          (lambda w: (w[:, 0, :].T.reshape(2, c, h),), lambda x: x.reshape(2, c * h).T[:, None, :]))
    b.add(prefix + names["conv0"] + ".bias", (c * h,), att + ("conv_depthwise_bias",), (i,),
          (lambda w: (w.reshape(c, h),), lambda x: x.reshape(-1)))
    b.add(prefix + names["conv1"] + ".weight", (c * h, h, 2), att + ("conv_grouped_weight",), (i,),
          (lambda w: (w.reshape(c, h, h, 2).transpose(3, 0, 2, 1),),
           lambda x: x.transpose(1, 3, 2, 0).reshape(c * h, h, 2)))
    b.add(prefix + names["conv1"] + ".bias", (c * h,), att + ("conv_grouped_bias",), (i,),
          (lambda w: (w.reshape(c, h),), lambda x: x.reshape(-1)))
    b.add(prefix + names["temp"], (k,), att + ("key_temperature",), (i,))
    b.add(prefix + names["o"], (d, n * h), att + ("o_proj",), (i,), _linear_in((n, h)))


def _router_entries(b: _Builder, cfg: ModelConfig, i: int, prefix: str, names: dict[str, str]) -> None:
    d, r, e = cfg.hidden_size, cfg.router_hidden_size, cfg.num_router_classes
    rt = ("layers", "moe", "router")
    transpose = (lambda w: (w.T,), lambda x: x.T)
    b.add(prefix + "down_proj.weight", (r, d), rt + ("down_proj",), (i,), transpose)
    b.add(prefix + "down_proj.bias", (r,), rt + ("down_bias",), (i,))
    if i > 0:  # the first MoE block has no EDA scale
        b.add(prefix + "router_states_scale", (r,), rt + ("state_scale",), (i,))
    b.add(prefix + names["norm"], (r,), rt + ("norm",), (i,))
    for ours, theirs in (("fc1", names["fc1"]), ("fc2", names["fc2"])):
        b.add(prefix + theirs + ".weight", (r, r), rt + (ours,), (i,), transpose)
        b.add(prefix + theirs + ".bias", (r,), rt + (ours + "_bias",), (i,))
    b.add(prefix + names["out"] + ".weight", (e, r), rt + ("out_proj",), (i,), transpose)
    b.add(prefix + "balancing_biases", (e,), rt + ("balancing_biases",), (i,))


def _residual_entries(b: _Builder, prefix: str, path: Path, index: tuple[int, ...], d: int,
                      with_residual: bool = True) -> None:
    names = ["hidden_states_scale", "hidden_states_bias"]
    names += ["residual_scale", "residual_bias"] if with_residual else []
    for name in names:
        b.add(prefix + name, (d,), path + (name,), index)


def _swiglu_split(i_size: int):
    def from_hf(w):  # [..., 2I, D] -> gate, up [..., D, I]
        return (np.swapaxes(w[..., :i_size, :], -1, -2), np.swapaxes(w[..., i_size:, :], -1, -2))

    def to_hf(gate, up):
        return np.concatenate([np.swapaxes(gate, -1, -2), np.swapaxes(up, -1, -2)], axis=-2)
    return from_hf, to_hf


_SWAP = (lambda w: (np.swapaxes(w, -1, -2),), lambda x: np.swapaxes(x, -1, -2))


def native_entries(cfg: ModelConfig) -> list[Entry]:
    d, e, i_size = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    b = _Builder()
    b.add("model.embed_tokens.weight", (cfg.vocab_size, d), ("embed",))
    b.add("model.input_hidden_states_scale", (d,), ("input_scale",))
    b.add("model.input_hidden_states_bias", (d,), ("input_bias",))
    b.add("model.norm.weight", (d,), ("final_norm", "weight"))
    cca_names = dict(q="self_attn.qkv_proj.q_proj.weight", k="self_attn.qkv_proj.k_proj.weight",
                     v_cur="self_attn.qkv_proj.v_proj_current.weight",
                     v_del="self_attn.qkv_proj.v_proj_delayed.weight",
                     conv0="self_attn.qkv_proj.conv_qk_depthwise", conv1="self_attn.qkv_proj.conv_qk_grouped",
                     temp="self_attn.qk_norm.temp", o="self_attn.o_proj.weight")
    router_names = dict(norm="router_mlp.norm.weight", fc1="router_mlp.fc1", fc2="router_mlp.fc2",
                        out="router_mlp.out_proj")
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        b.add(p + "input_layernorm.weight", (d,), ("layers", "input_norm", "weight"), (i,))
        b.add(p + "post_attention_layernorm.weight", (d,), ("layers", "post_attention_norm", "weight"), (i,))
        _cca_entries(b, cfg, i, p, cca_names)
        _residual_entries(b, p + "post_attention_residual_scale.", ("layers", "attention_residual"), (i,), d)
        _residual_entries(b, p + "post_mlp_residual_scale.", ("layers", "moe_residual"), (i,), d)
        _router_entries(b, cfg, i, p + "mlp.gate.", router_names)
        moe = ("layers", "moe")
        b.add_multi(p + "mlp.experts.gate_up_proj", (e, 2 * i_size, d),
                    ((moe + ("gate",), (i,)), (moe + ("up",), (i,))), *_swiglu_split(i_size))
        b.add(p + "mlp.experts.down_proj", (e, d, i_size), moe + ("down",), (i,), _SWAP)
    return b.entries


def original_entries(cfg: ModelConfig) -> list[Entry]:
    d, e, i_size, num = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, cfg.num_layers
    b = _Builder()
    b.add("model.embed_tokens.weight", (cfg.vocab_size, d), ("embed",))
    b.add("model.layers.0.res_scale.hidden_states_scale", (d,), ("input_scale",))
    b.add("model.layers.0.res_scale.hidden_states_bias", (d,), ("input_bias",))
    b.add("model.final_norm.weight", (d,), ("final_norm", "weight"))
    _residual_entries(b, "model.res_scale.", ("layers", "moe_residual"), (num - 1,), d)
    cca_names = dict(q="self_attn.qkv.linear_q.weight", k="self_attn.qkv.linear_k.weight",
                     v_cur="self_attn.qkv.val_proj1.weight", v_del="self_attn.qkv.val_proj2.weight",
                     conv0="self_attn.qkv.conv_qk.0", conv1="self_attn.qkv.conv_qk.1",
                     temp="self_attn.qkv.temp", o="self_attn.o_proj.weight")
    router_names = dict(norm="rmsnorm_eda.weight", fc1="router_mlp.0", fc2="router_mlp.2", out="router_mlp.4")
    for i in range(num):
        att, moe = f"model.layers.{2 * i}.", f"model.layers.{2 * i + 1}."
        b.add(att + "input_norm.weight", (d,), ("layers", "input_norm", "weight"), (i,))
        b.add(moe + "input_norm.weight", (d,), ("layers", "post_attention_norm", "weight"), (i,))
        _cca_entries(b, cfg, i, att, cca_names)
        _residual_entries(b, moe + "res_scale.", ("layers", "attention_residual"), (i,), d)
        if i + 1 < num:
            _residual_entries(b, f"model.layers.{2 * i + 2}.res_scale.", ("layers", "moe_residual"), (i,), d)
        _router_entries(b, cfg, i, moe + "zaya_block.router.", router_names)
        for j in range(e):
            ex = f"{moe}zaya_block.experts.local_experts.{j}."
            b.add_multi(ex + "linear_fc1.weight", (2 * i_size, d),
                        ((("layers", "moe", "gate"), (i, j)), (("layers", "moe", "up"), (i, j))),
                        *_swiglu_split(i_size))
            b.add(ex + "linear_fc2.weight", (d, i_size), ("layers", "moe", "down"), (i, j), _SWAP)
    return b.entries


ENTRIES = {"native": native_entries, "original": original_entries}
# Tensors a checkpoint may hold that carry no parameters of ours.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.original_inv_freq")
TIED_HEAD = "lm_head.weight"
