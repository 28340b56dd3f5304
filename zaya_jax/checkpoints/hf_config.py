"""HF `config.json` <-> ModelConfig, for both ZAYA checkpoint schemas.

native   (transformers `ZayaConfig`, ZAYA1-8B): num_hidden_layers = decoder layers (CCA + MoE),
         skip slot outputs 0, residual stream in fp32; `layer_types` ("hybrid" | "hybrid_sliding"
         per layer), `sliding_window`, and one RoPE entry per layer type in `rope_parameters`
         ("hybrid" -> rope_theta and rope_scaling, "hybrid_sliding" -> sliding_rope_theta and
         sliding_rope_scaling; transformers' defaults 5e6 and 1e4, unscaled; both written; hf_rope).
original (Zyphra's ZAYA1-base): `zaya_layers` lists 2L alternating sub-layers ('a' = CCA,
         an int = a MoE block with that many experts); `num_hidden_layers` is ignored (the
         released config says 120); skip slot outputs p * x; router norm eps `layernorm_epsilon`.
         Sliding-window layers: `swa_layers`, one boolean per CCA layer (legacy converters map it
         to transformers' "hybrid_sliding"), `sliding_window`, and `swa_rope_theta` for their RoPE
         base (a key of ours: the legacy configs' own name for it is not known; default 1e4).
         RoPE scaling (`rope_scaling` in these configs) has no reader here: a set one is refused.

ZAYA_FIELDS says, for every field of transformers' `ZayaConfig` (5.25), how the native reader takes
it: "read" into the ModelConfig fields named, "fixed" (only the values listed compute what zaya_jax
computes; any other is refused naming the field, before anything is built), or "inert" (transformers'
ZAYA computes no logit or gradient from it; why is given). RoPE: zaya_jax.checkpoints.hf_rope.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from zaya_jax.config import LAYER_TYPES, ModelConfig
from zaya_jax.checkpoints.hf_rope import rope_fields_from_hf, rope_parameters_to_hf
from zaya_jax.errors import UserError


class HFCheckpointError(UserError, ValueError):
    """An HF checkpoint directory that is not a ZAYA checkpoint this code reads; names the file and key."""


class HFFileMissing(UserError, FileNotFoundError):
    """A file an HF checkpoint directory must hold is absent."""


def detect_schema(hf: dict[str, Any]) -> str:
    if hf.get("model_type") == "zaya1_vl":
        raise HFCheckpointError("config.json: a zaya1_vl (vision-language) checkpoint; load it with "
                                "zaya_jax.checkpoints.hf_vl.load_vl_hf (docs/vision.md)")
    if hf.get("model_type") != "zaya":
        raise HFCheckpointError(f"config.json: model_type is {hf.get('model_type')!r}, expected 'zaya'")
    return "original" if "zaya_layers" in hf else "native"


class Field(NamedTuple):
    """How a field of a transformers config class is taken (module docstring)."""
    kind: str                 # "read", "fixed" or "inert"
    detail: Any               # read: the ModelConfig fields; fixed: the values allowed; inert: why
    default: Any = None       # fixed: transformers' default, when config.json leaves the field out


def read(fields: str) -> Field:
    return Field("read", fields)


def fixed(allowed: tuple, default) -> Field:
    return Field("fixed", allowed, default)


def inert(why: str) -> Field:
    return Field("inert", why)


_CLASSIFICATION = inert("read by classification heads only")
# PreTrainedConfig's own fields, which every transformers config class has
PRETRAINED_FIELDS = {
    "transformers_version": inert("the version that wrote the file"),
    "architectures": inert("class names; the tensors decide what loads (each name and shape is checked)"),
    "output_hidden_states": inert("what forward returns besides the logits"),
    "return_dict": inert("the type forward returns"),
    "dtype": inert("the stored tensors' dtype; zaya_jax reads them in float32 and computes in model.dtype"),
    "chunk_size_feed_forward": inert("read by apply_chunking_to_forward, which ZAYA does not call"),
    "is_encoder_decoder": fixed((False,), False),
    "id2label": _CLASSIFICATION, "label2id": _CLASSIFICATION, "problem_type": _CLASSIFICATION,
}
_ROPE = read("rope_theta, sliding_rope_theta, rope_scaling, sliding_rope_scaling, partial_rotary_factor (hf_rope)")
# transformers 5.25 models/zaya/configuration_zaya.py, class ZayaConfig
ZAYA_FIELDS = {
    **PRETRAINED_FIELDS,
    "vocab_size": read("vocab_size"), "hidden_size": read("hidden_size"), "num_hidden_layers": read("num_layers"),
    "num_attention_heads": read("num_q_heads"), "num_key_value_heads": read("num_kv_heads"),
    "hidden_act": fixed(("silu", "swish"), "silu"),  # the experts' ACT2FN: both are x * sigmoid(x)
    "max_position_embeddings": read("max_position_embeddings"),
    "initializer_range": inert("weight init; a checkpoint holds every weight"),
    "rms_norm_eps": read("rms_norm_eps, router_norm_eps"),
    "use_cache": inert("whether generation keeps a cache; the logits are the same"),
    "tie_word_embeddings": fixed((True,), True),
    "rope_parameters": _ROPE,
    "sliding_window": read("sliding_window"),
    "attention_dropout": fixed((0,), 0.0),  # dropped attention weights in training; zaya_jax has none
    "moe_intermediate_size": read("moe_intermediate_size"),
    "num_experts_per_tok": fixed((1,), 1),
    "num_experts": read("num_experts"),
    "output_router_logits": inert("returns the router logits; ZayaForCausalLM adds no loss from them"),
    "layer_types": read("layer_types"),
    "pad_token_id": read("pad_token_id (the embedding's padding_idx: no gradient from its lookups)"),
    "bos_token_id": read("bos_token_id"), "eos_token_id": read("eos_token_id"),
    "head_dim": read("head_dim"),
    "attention_bias": fixed((False,), False), "lm_head_bias": fixed((False,), False),
    "router_hidden_size": read("router_hidden_size"),
    "cca_time0": fixed((2,), 2), "cca_time1": fixed((2,), 2),
}


def _require(hf: dict, key: str, prefix: str = ""):
    if key not in hf:
        raise HFCheckpointError(f"config.json: missing required key {prefix}{key!r}")
    return hf[key]


def _expect(hf: dict, key: str, allowed, default, prefix: str = "") -> None:
    value = hf.get(key, default)
    if value not in allowed or isinstance(value, bool) != isinstance(allowed[0], bool):
        raise HFCheckpointError(f"config.json: {prefix}{key}={value!r} is not supported (zaya_jax computes "
                                f"{' or '.join(map(repr, allowed))})")


def check_fixed(hf: dict, fields: dict[str, Field], prefix: str = "") -> None:
    """Refuses, naming it, the first field `fields` fixes whose value in `hf` is not one it allows."""
    for key, rule in fields.items():
        if rule.kind == "fixed":
            _expect(hf, key, rule.detail, rule.default, prefix)


def _token_id(hf: dict, key: str, default: int, prefix: str) -> int:
    """bos / eos / pad: an id (eos may be a list of one id); null or several ids are refused."""
    value = hf.get(key, default)
    ids = sorted(set(value)) if isinstance(value, (list, tuple)) else [value]
    if len(ids) != 1 or not isinstance(ids[0], int) or isinstance(ids[0], bool):
        why = {"pad_token_id": "the embedding's padding row (no gradient from its lookups) and generation's filler",
               "eos_token_id": "one id, where generation stops"}.get(key, "one id")
        raise HFCheckpointError(f"config.json: {prefix}{key}={value!r}: zaya_jax needs {why}; set one token id"
                                + (" (pass the other stop ids to generate's stop_ids)" if len(ids) > 1 else ""))
    return ids[0]


def _native_to_model(hf: dict, fields: dict[str, Field] = ZAYA_FIELDS, prefix: str = "") -> dict:
    """A ZAYA text config dict (ZayaConfig's fields, or Zaya1VLTextConfig's under `prefix`) -> ModelConfig
    fields; every field of `fields` fixed to other values, and every RoPE setting transformers computes
    differently, refused naming it."""
    check_fixed(hf, fields, prefix)
    layers = _require(hf, "num_hidden_layers", prefix)
    layer_types = hf.get("layer_types") or ["hybrid"] * layers
    if set(layer_types) - set(LAYER_TYPES):
        raise HFCheckpointError(f"config.json: {prefix}layer_types {sorted(set(layer_types))} are not all among "
                                f"{LAYER_TYPES}")
    head_dim = _require(hf, "head_dim", prefix)
    rope = rope_fields_from_hf(hf, layer_types, head_dim, prefix)
    return dict(
        **_layer_types_to_model(list(layer_types), hf.get("sliding_window"), rope.pop("sliding_rope_theta")),
        **rope,
        vocab_size=_require(hf, "vocab_size", prefix), hidden_size=_require(hf, "hidden_size", prefix),
        num_layers=layers, num_q_heads=_require(hf, "num_attention_heads", prefix),
        num_kv_heads=_require(hf, "num_key_value_heads", prefix), head_dim=head_dim,
        num_experts=_require(hf, "num_experts", prefix),
        moe_intermediate_size=_require(hf, "moe_intermediate_size", prefix),
        router_hidden_size=hf.get("router_hidden_size", 256),
        max_position_embeddings=hf.get("max_position_embeddings", 131_072),
        rms_norm_eps=hf.get("rms_norm_eps", 1e-5), router_norm_eps=hf.get("rms_norm_eps", 1e-5),
        layout="native", residual_in_fp32=True,
        pad_token_id=_token_id(hf, "pad_token_id", 0, prefix), bos_token_id=_token_id(hf, "bos_token_id", 2, prefix),
        eos_token_id=_token_id(hf, "eos_token_id", 106, prefix),
    )


def _layer_types_to_model(layer_types: list[str], window, sliding_theta) -> dict:
    """ModelConfig's layer_types (() when every layer is full), sliding_window, sliding_rope_theta."""
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise HFCheckpointError(f"config.json: sliding_window={window!r} must be a positive integer or null")
    if "hybrid_sliding" in layer_types and window is None:
        raise HFCheckpointError("config.json: layer_types has 'hybrid_sliding' layers but sliding_window is null")
    return dict(layer_types=tuple(layer_types) if "hybrid_sliding" in layer_types else (),
                sliding_window=window or 0, sliding_rope_theta=float(sliding_theta))


def _swa_layers(hf: dict, num_layers: int) -> list[str]:
    """The original schema's `swa_layers` (one boolean per CCA layer) -> layer types."""
    flags = hf.get("swa_layers") or [False] * num_layers
    if len(flags) != num_layers or any(not isinstance(f, (bool, int)) for f in flags):
        raise HFCheckpointError(f"config.json: swa_layers must list one boolean per CCA layer ({num_layers}); "
                                f"got {flags[:6]}...")
    return ["hybrid_sliding" if f else "hybrid" for f in flags]


def _original_to_model(hf: dict) -> dict:
    sub_layers = _require(hf, "zaya_layers")
    if len(sub_layers) % 2 or any((s == "a") != (n % 2 == 0) for n, s in enumerate(sub_layers)):
        raise HFCheckpointError("config.json: zaya_layers must alternate 'a' (CCA) and a MoE expert count, "
                                f"starting with 'a'; got {sub_layers[:6]}...")
    experts = {s for s in sub_layers[1::2]}
    if len(experts) != 1:
        raise HFCheckpointError(f"config.json: zaya_layers mixes expert counts {sorted(experts)}")
    _expect(hf, "moe_router_topk", (1,), 1)
    _expect(hf, "add_bias_linear", (False,), False)
    _expect(hf, "zaya_use_mod", (True,), True)
    _expect(hf, "zaya_use_eda", (True,), True)
    _expect(hf, "scale_residual_merge", (True,), True)
    _expect(hf, "tie_word_embeddings", (True,), True)
    _expect(hf, "clamp_temp", (False,), False)
    if hf.get("rope_scaling"):
        raise HFCheckpointError(f"config.json: rope_scaling={hf['rope_scaling']!r}: Zyphra's original schema is read "
                                "unscaled here; a scaled ZAYA loads from transformers' schema (rope_parameters)")
    hidden = _require(hf, "hidden_size")
    heads = _require(hf, "num_attention_heads")
    head_dim = hf.get("kv_channels") or hidden // heads
    kv_heads = hf.get("num_query_groups_list", [None])[0] or hf.get("num_key_value_heads", 2)
    return dict(
        **_layer_types_to_model(_swa_layers(hf, len(sub_layers) // 2), hf.get("sliding_window"),
                                hf.get("swa_rope_theta", 10_000.0)),
        vocab_size=_require(hf, "vocab_size"), hidden_size=hidden, num_layers=len(sub_layers) // 2,
        num_q_heads=hf.get("cca_num_q_heads") or heads // 2, num_kv_heads=kv_heads, head_dim=head_dim,
        num_experts=experts.pop(), moe_intermediate_size=_require(hf, "ffn_hidden_size") // 2,
        router_hidden_size=hf.get("zaya_mlp_expansion", 256),
        rope_theta=float(hf.get("rope_theta", 10_000.0)),
        partial_rotary_factor=float(hf.get("partial_rotary_factor", 0.5)),
        max_position_embeddings=hf.get("max_position_embeddings", 32_768),
        rms_norm_eps=hf.get("norm_epsilon", 1e-5), router_norm_eps=hf.get("layernorm_epsilon", 1e-6),
        layout="base", residual_in_fp32=bool(hf.get("residual_in_fp32", False)),
        pad_token_id=hf.get("pad_token_id") or 0, bos_token_id=hf.get("bos_token_id", 2),
        eos_token_id=_token_id(hf, "eos_token_id", 1, ""),
    )


def model_config_from_hf(hf: dict[str, Any], **overrides) -> tuple[ModelConfig, str]:
    """-> (ModelConfig, schema). `overrides` set non-architecture fields (dtype, moe_backend, ...)."""
    schema = detect_schema(hf)
    values = _original_to_model(hf) if schema == "original" else _native_to_model(hf)
    return ModelConfig(**{**values, **overrides}), schema


def hf_config_from_model(cfg: ModelConfig, schema: str) -> dict[str, Any]:
    if schema == "original":
        return {
            "model_type": "zaya", "architectures": ["ZayaForCausalLM"],
            "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
            "num_attention_heads": cfg.num_q_heads * 2, "cca_num_q_heads": cfg.num_q_heads,
            "kv_channels": cfg.head_dim, "num_key_value_heads": cfg.num_kv_heads,
            "num_query_groups_list": [cfg.num_kv_heads] * cfg.num_layers,
            "num_hidden_layers": 2 * cfg.num_layers, "zaya_layers": ["a", cfg.num_experts] * cfg.num_layers,
            "ffn_hidden_size": 2 * cfg.moe_intermediate_size, "zaya_mlp_expansion": cfg.router_hidden_size,
            "rope_theta": cfg.rope_theta, "partial_rotary_factor": cfg.partial_rotary_factor,
            "max_position_embeddings": cfg.max_position_embeddings, "norm_epsilon": cfg.rms_norm_eps,
            "layernorm_epsilon": cfg.router_norm_eps, "residual_in_fp32": cfg.residual_in_fp32,
            "moe_router_topk": 1, "zaya_use_mod": True, "zaya_use_eda": True, "scale_residual_merge": True,
            "add_bias_linear": False, "tie_word_embeddings": True, "pad_token_id": cfg.pad_token_id,
            "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id,
            "swa_layers": list(cfg.sliding_layers), "sliding_window": cfg.sliding_window or None,
            "swa_rope_theta": cfg.sliding_rope_theta,
        }
    return {
        "model_type": "zaya", "architectures": ["ZayaForCausalLM"],
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_q_heads, "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim, "num_experts": cfg.num_experts, "num_experts_per_tok": 1,
        "moe_intermediate_size": cfg.moe_intermediate_size, "router_hidden_size": cfg.router_hidden_size,
        "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.rms_norm_eps,
        "layer_types": list(cfg.layer_types) or ["hybrid"] * cfg.num_layers,
        "sliding_window": cfg.sliding_window or None,
        "rope_parameters": rope_parameters_to_hf(cfg),
        "tie_word_embeddings": True, "attention_bias": False, "lm_head_bias": False,
        "cca_time0": 2, "cca_time1": 2, "hidden_act": "silu",
        "pad_token_id": cfg.pad_token_id, "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id,
    }
