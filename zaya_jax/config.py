"""Validated model configuration.

The config files under configs/ are ml_collections ConfigDicts (the single source of
hyper-parameters, overridable from the command line). `ModelConfig.from_config` turns the
`model` section into a frozen dataclass and rejects invalid combinations with a message that
names the offending field, before anything is built or compiled.

Layouts (`model.layout`):
  "base"   ZAYA1-base, Zyphra's original code: a token routed to the skip slot outputs p * x.
  "native" ZAYA1-8B / HF transformers `ZayaForCausalLM`: a skip-routed token outputs 0.
Both run the same maths otherwise; `residual_in_fp32`, `rope_theta` and `router_norm_eps`
are separate fields that the config files set per layout.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterable, Mapping

from zaya_jax.errors import UserError

LAYOUTS = ("base", "native")
COMPUTE_DTYPES = ("float32", "bfloat16")
MOE_BACKENDS = ("auto", "dense", "capacity", "ragged", "tiles", "native")
REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch", "dots_no_batch_and_kernels")
KERNELS = ("auto", "xla", "pallas")
# matmul recipes (zaya_jax.model.fp8): the compute dtype, or FP8 expert and CCA projection matmuls
MATMUL_PRECISIONS = ("default", "fp8", "fp8_gpu", "fp8_nanoo")
EXPERT_PARALLEL = ("all_to_all", "all_gather", "ragged_all_to_all")
LAYER_TYPES = ("hybrid", "hybrid_sliding")  # transformers' ZayaConfig.layer_types: full / sliding-window CCA
# transformers' RoPE types (modeling_rope_utils.ROPE_INIT_FUNCTIONS and "default") that zaya_jax computes, and
# the rope_parameters keys each reads besides rope_type, rope_theta and partial_rotary_factor
ROPE_TYPE_KEYS = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow", "mscale",
             "mscale_all_dim", "truncate"),
    "longrope": ("factor", "original_max_position_embeddings", "attention_factor", "short_factor", "long_factor"),
    "llama3": ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"),
}
# Fields that choose how the model runs, not what it computes; an HF checkpoint does not carry them.
RUNTIME_MODEL_FIELDS = ("dtype", "scan_layers", "remat", "moe_backend", "capacity_factor", "moe_tile_size",
                        "expert_parallel", "attention_kernel", "moe_matmul_kernel", "matmul_precision", "init_std",
                        "key_temperature_init", "isolate_documents")
VISION_LORA_FIELDS = ("vision_lora_rank_attn", "vision_lora_rank_mlp")  # ZAYA1-VL's adapters (0: none)
ROPE_SCALING_FIELDS = ("rope_scaling", "sliding_rope_scaling")  # full and sliding layers' RopeScaling


class ConfigError(UserError, ValueError):
    """A config field or override with a bad value; the message names the field."""


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """The RoPE scaling of one layer type: transformers' `rope_parameters[layer type]` keys, with the
    layer type's base (ModelConfig.rope_theta / sliding_rope_theta) and rotary dims (ModelConfig.rotary_dim)
    kept outside. The maths is zaya_jax.model.rope's; ROPE_TYPE_KEYS names the keys each type reads, and
    the others must keep their defaults. 0 stands where transformers takes null to mean "derive it"."""

    rope_type: str = "default"
    factor: float = 0.0                        # 0: not given (yarn, longrope derive M / O; the others need it)
    original_max_position_embeddings: int = 0  # the pre-scaling context (yarn, longrope, llama3: required)
    attention_factor: float = 0.0              # multiplies cos and sin (yarn, longrope); 0 = from factor
    beta_fast: float = 32.0                    # yarn's correction range, in rotations
    beta_slow: float = 1.0
    mscale: float = 0.0                        # yarn: with mscale_all_dim, the attention factor's form
    mscale_all_dim: float = 0.0
    truncate: bool = True                      # yarn: round the correction range outwards
    short_factor: tuple[float, ...] = ()       # longrope: per-frequency divisors [rotary_dim / 2], used up to
    long_factor: tuple[float, ...] = ()        # original_max_position_embeddings tokens, and past it
    low_freq_factor: float = 1.0               # llama3: the wavelengths band that is interpolated
    high_freq_factor: float = 4.0

    def __post_init__(self):
        for name, default in self.defaults().items():  # a config file or JSON may give lists, ints for floats
            value = getattr(self, name)
            if isinstance(value, (list, tuple)):
                object.__setattr__(self, name, tuple(value))
            elif isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
                object.__setattr__(self, name, float(value))

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        return {f.name: f.default for f in dataclasses.fields(cls)}

    @classmethod
    def from_value(cls, value: Any, field: str) -> "RopeScaling":
        """A RopeScaling, or a mapping (config file section, JSON) of its keys -> RopeScaling."""
        if isinstance(value, cls):
            return value
        if not hasattr(value, "items"):
            raise ConfigError(f"{field} must be a mapping of RoPE scaling keys ({', '.join(cls.defaults())}), "
                              f"got {value!r}")
        values = dict(value.items())
        unknown = sorted(set(values) - set(cls.defaults()))
        if unknown:
            raise ConfigError(f"{field}.{unknown[0]}: unknown key (known keys: {', '.join(cls.defaults())})")
        return cls(**values)

    def used_keys(self) -> tuple[str, ...]:
        """The keys this rope_type reads (besides rope_type)."""
        return ROPE_TYPE_KEYS.get(self.rope_type, ())


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shapes and numerics of one ZAYA1 model.

    One decoder layer is a CCA attention block followed by a MoE block (ZAYA1-base: 40 layers,
    i.e. the 80 alternating sub-layers of the original code).
    """

    vocab_size: int = 262_272
    hidden_size: int = 2048
    num_layers: int = 40
    num_q_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 128
    num_experts: int = 16
    moe_intermediate_size: int = 2048
    router_hidden_size: int = 256
    rope_theta: float = 1_000_000.0
    # per-layer attention: () = every layer "hybrid" (full causal), else one of LAYER_TYPES per layer;
    # a "hybrid_sliding" layer's query sees its own and the sliding_window - 1 keys before it, and
    # rotates with sliding_rope_theta (curriculum phases change rope_theta only; docs/model.md)
    layer_types: tuple[str, ...] = ()
    sliding_window: int = 0
    sliding_rope_theta: float = 10_000.0
    # transformers' RoPE scaling (rope_parameters["hybrid"] / ["hybrid_sliding"]; docs/model.md): a
    # RopeScaling, or a mapping of its keys
    rope_scaling: RopeScaling = RopeScaling()
    sliding_rope_scaling: RopeScaling = RopeScaling()
    partial_rotary_factor: float = 0.5
    max_position_embeddings: int = 32_768
    rms_norm_eps: float = 1e-5
    router_norm_eps: float = 1e-5
    layout: str = "base"
    residual_in_fp32: bool = False
    isolate_documents: bool = True
    dtype: str = "float32"
    scan_layers: bool = True
    remat: str = "none"
    moe_backend: str = "auto"
    capacity_factor: float = 1.25
    moe_tile_size: int = 64
    expert_parallel: str = "all_to_all"
    attention_kernel: str = "auto"
    moe_matmul_kernel: str = "auto"
    # "default": every matmul in `dtype`; an FP8 recipe of zaya_jax.model.fp8 (docs/fp8.md): the
    # expert and CCA q/k/v/o matmuls in FP8 (e4m3 forward, e5m2 gradients, per-tensor scaling)
    matmul_precision: str = "default"
    init_std: float = 0.02
    key_temperature_init: float = 1.0
    # ZAYA1-VL's vision LoRA (docs/vision.md): adapters of these ranks on CCA's projections and on the
    # experts, applied at image positions only; 0 = none (the text model)
    vision_lora_rank_attn: int = 0
    vision_lora_rank_mlp: int = 0
    pad_token_id: int = 0
    bos_token_id: int = 2
    eos_token_id: int = 1

    def __post_init__(self):
        if isinstance(self.layer_types, (list, tuple)):  # a config file or ConfigDict may hold a list;
            types = tuple(self.layer_types)                 # every layer full is spelled ()
            object.__setattr__(self, "layer_types", () if set(types) == {"hybrid"} else types)
        for name in ROPE_SCALING_FIELDS:
            object.__setattr__(self, name, RopeScaling.from_value(getattr(self, name), f"model.{name}"))
        _validate(self)

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """{field: default} for every field, in declaration order (a RopeScaling as a dict of its keys)."""
        return {f.name: dataclasses.asdict(f.default) if isinstance(f.default, RopeScaling) else f.default
                for f in dataclasses.fields(cls)}

    @classmethod
    def check_field_names(cls, names: Iterable[str]) -> None:
        """Raises naming the first name that is not a field."""
        known = cls.defaults()
        unknown = sorted(set(names) - set(known))
        if unknown:
            raise ConfigError(f"model.{unknown[0]}: unknown field (known fields: {', '.join(sorted(known))})")

    @classmethod
    def from_config(cls, section: Mapping[str, Any] | Any) -> "ModelConfig":
        """Builds from the `model` section of a config (ConfigDict or mapping)."""
        values = dict(section.items()) if hasattr(section, "items") else dict(section)
        cls.check_field_names(values)
        return cls(**values)

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    @property
    def num_router_classes(self) -> int:
        """Experts plus the skip (Mixture-of-Depths) slot."""
        return self.num_experts + 1

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def position_limit(self) -> int | None:
        """The most positions generation may reach: max_position_embeddings, or None where a layer type in
        use scales its RoPE dynamically (its base grows past max_position_embeddings, as in transformers)."""
        used = [self.sliding_rope_scaling if sliding else self.rope_scaling for sliding in set(self.sliding_layers)]
        return None if any(s.rope_type == "dynamic" for s in used) else self.max_position_embeddings

    @property
    def sliding_layers(self) -> tuple[bool, ...]:
        """[L] True where the layer is "hybrid_sliding" (windowed attention)."""
        return tuple(t == "hybrid_sliding" for t in self.layer_types) or (False,) * self.num_layers

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.num_q_heads // self.num_kv_heads

    @property
    def conv_channels(self) -> int:
        """Packed q|k channels fed to the CCA convolutions."""
        return (self.num_q_heads + self.num_kv_heads) * self.head_dim


def _validate(c: ModelConfig) -> None:
    positive = ("vocab_size", "hidden_size", "num_layers", "num_q_heads", "num_kv_heads", "head_dim",
                "num_experts", "moe_intermediate_size", "router_hidden_size", "max_position_embeddings",
                "moe_tile_size")
    for name in positive:
        value = getattr(c, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"model.{name} must be a positive integer, got {value!r}")
    for name in ("rope_theta", "sliding_rope_theta", "rms_norm_eps", "router_norm_eps", "capacity_factor", "init_std"):
        if not getattr(c, name) > 0:
            raise ConfigError(f"model.{name} must be > 0, got {getattr(c, name)!r}")
    if c.num_q_heads % c.num_kv_heads:
        raise ConfigError(f"model.num_q_heads ({c.num_q_heads}) must be a multiple of "
                          f"model.num_kv_heads ({c.num_kv_heads})")
    if c.num_kv_heads % 2:
        raise ConfigError(f"model.num_kv_heads ({c.num_kv_heads}) must be even: CCA's value shift takes "
                          "half of the KV heads from the current token and half from the previous one")
    if not 0 < c.partial_rotary_factor <= 1 or c.rotary_dim % 2:
        raise ConfigError(f"model.partial_rotary_factor ({c.partial_rotary_factor}) must give an even "
                          f"number of rotary dims in (0, head_dim]; got {c.rotary_dim}")
    for name, allowed in (("layout", LAYOUTS), ("dtype", COMPUTE_DTYPES), ("moe_backend", MOE_BACKENDS),
                          ("remat", REMAT_POLICIES), ("attention_kernel", KERNELS),
                          ("moe_matmul_kernel", KERNELS), ("expert_parallel", EXPERT_PARALLEL),
                          ("matmul_precision", MATMUL_PRECISIONS)):
        if getattr(c, name) not in allowed:
            raise ConfigError(f"model.{name}={getattr(c, name)!r} does not exist; choose one of {allowed}")
    if c.matmul_precision != "default" and (c.moe_backend not in ("auto", "ragged")
                                            or c.moe_matmul_kernel not in ("auto", "xla")):
        raise ConfigError(f"model.matmul_precision={c.matmul_precision!r} runs the experts as FP8 ragged_dot; set "
                          f"model.moe_backend to 'auto' or 'ragged' and model.moe_matmul_kernel to 'auto' or 'xla' "
                          f"(got {c.moe_backend!r}, {c.moe_matmul_kernel!r})")
    for name in VISION_LORA_FIELDS:
        value = getattr(c, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ConfigError(f"model.{name} must be a non-negative integer (0: no vision LoRA), got {value!r}")
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if not 0 <= getattr(c, name) < c.vocab_size:
            raise ConfigError(f"model.{name} ({getattr(c, name)}) must lie in [0, vocab_size={c.vocab_size})")
    _validate_layer_types(c)
    for name in ROPE_SCALING_FIELDS:
        validate_rope_scaling(getattr(c, name), f"model.{name}", c.rotary_dim)


def validate_rope_scaling(s: RopeScaling, field: str, rotary_dim: int) -> None:
    """Each key the rope_type reads holds a value transformers computes with; the others their defaults."""
    if s.rope_type not in ROPE_TYPE_KEYS:
        raise ConfigError(f"{field}.rope_type={s.rope_type!r} is not supported; choose one of "
                          f"{tuple(ROPE_TYPE_KEYS)} (transformers' other types are refused)")
    defaults = RopeScaling.defaults()
    for key, default in defaults.items():
        if key != "rope_type" and key not in s.used_keys() and getattr(s, key) != default:
            raise ConfigError(f"{field}.{key}={getattr(s, key)!r} has no effect with rope_type {s.rope_type!r}; "
                              f"leave it at {default!r} (the keys {s.rope_type!r} reads: {s.used_keys() or 'none'})")
    keys = s.used_keys()
    numbers = [k for k in keys if k not in ("truncate", "short_factor", "long_factor")]
    for key in numbers:
        value = getattr(s, key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ConfigError(f"{field}.{key} must be a non-negative number, got {value!r}")
    derived = ("attention_factor", "mscale", "mscale_all_dim") + (("factor",) if s.rope_type in ("yarn", "longrope")
                                                                   else ())
    for key in numbers:
        if getattr(s, key) == 0 and key not in derived:
            raise ConfigError(f"{field}.{key} must be > 0 for rope_type {s.rope_type!r}"
                              + (" (the context it was trained at)" if key == "original_max_position_embeddings"
                                 else ""))
    if "original_max_position_embeddings" in keys and not isinstance(s.original_max_position_embeddings, int):
        raise ConfigError(f"{field}.original_max_position_embeddings must be an integer, got "
                          f"{s.original_max_position_embeddings!r}")
    if s.rope_type == "dynamic" and rotary_dim <= 2:
        raise ConfigError(f"{field}: dynamic RoPE raises the base to R / (R - 2) for R = {rotary_dim} rotary dims; "
                          "it needs more than 2")
    if s.rope_type == "longrope":
        for key in ("short_factor", "long_factor"):
            factors = getattr(s, key)
            if len(factors) != rotary_dim // 2 or not all(isinstance(f, (int, float)) and f > 0 for f in factors):
                raise ConfigError(f"{field}.{key} must list {rotary_dim // 2} positive numbers (one per rotary "
                                  f"frequency: rotary_dim {rotary_dim} / 2), got {len(factors)}: {factors[:4]}")
    if not isinstance(s.truncate, bool):
        raise ConfigError(f"{field}.truncate must be true or false, got {s.truncate!r}")


def _validate_layer_types(c: ModelConfig) -> None:
    if not isinstance(c.layer_types, tuple) or any(t not in LAYER_TYPES for t in c.layer_types):
        raise ConfigError(f"model.layer_types={c.layer_types!r}: each entry must be one of {LAYER_TYPES} "
                          "(or leave it empty: every layer 'hybrid')")
    if c.layer_types and len(c.layer_types) != c.num_layers:
        raise ConfigError(f"model.layer_types lists {len(c.layer_types)} layers but model.num_layers is "
                          f"{c.num_layers}; give one type per layer")
    window = c.sliding_window
    if not isinstance(window, int) or isinstance(window, bool) or window < 0:
        raise ConfigError(f"model.sliding_window must be a non-negative integer, got {window!r}")
    if any(c.sliding_layers) and window <= 0:
        raise ConfigError(f"model.sliding_window={window} but model.layer_types has 'hybrid_sliding' layers; "
                          "set model.sliding_window to the window (keys per query, > 0)")
