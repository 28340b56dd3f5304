"""transformers' `rope_parameters` (ZayaConfig, Zaya1VLTextConfig) <-> ModelConfig's RoPE fields.

transformers nests one entry per layer type, "hybrid" (-> rope_theta, rope_scaling) and
"hybrid_sliding" (-> sliding_rope_theta, sliding_rope_scaling); each holds rope_type, rope_theta,
partial_rotary_factor (absent: 1.0, the whole head) and the keys its type reads
(config.ROPE_TYPE_KEYS). Read as transformers 5.25 computes from them, or refused in one line:

- an absent `rope_parameters` is ZayaConfig's default: 5e6 and 1e4, both half the head, unscaled;
- an entry of a layer type in use that is missing, or lacks rope_theta or a key its type requires
  (transformers' KeyError), is refused; so is an unused key (transformers warns and ignores it), a
  rope_type zaya_jax does not compute (proportional, which pairs dims across the whole head, or any
  other), and a top-level `rope_type` other than "default" (ZayaConfig deletes it unread);
- yarn's `truncate` is read where transformers reads it: `rope_parameters["truncate"]` at the top
  level (default true), for every yarn entry; one inside an entry, which it never reads, must agree;
- null stands for "derive it": factor (yarn, longrope: M / O), attention_factor; beta_fast,
  beta_slow null or 0 are 32 and 1 (transformers' `or`); mscale, mscale_all_dim null are 0.
The old top-level name `rope_scaling` (which transformers' setter would put in place of
rope_parameters) is refused naming rope_parameters.
"""

from __future__ import annotations

from typing import Any

from zaya_jax.config import ROPE_TYPE_KEYS, ConfigError, ModelConfig, RopeScaling, validate_rope_scaling
from zaya_jax.errors import UserError

ENTRIES = {"hybrid": ("rope_theta", "rope_scaling"), "hybrid_sliding": ("sliding_rope_theta", "sliding_rope_scaling")}
# ZayaConfig.__post_init__'s rope_parameters when config.json has none
ZAYA_DEFAULTS = {"hybrid": {"rope_type": "default", "rope_theta": 5_000_000.0, "partial_rotary_factor": 0.5},
                 "hybrid_sliding": {"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.5}}
# keys transformers' _validate_<type>_rope_parameters require (ZayaConfig fills in none of them)
REQUIRED = {"linear": ("factor",), "dynamic": ("factor",), "yarn": ("factor", "original_max_position_embeddings"),
            "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
            "llama3": ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor")}
DERIVED_WHEN_NULL = {"factor": ("yarn", "longrope"), "attention_factor": ("yarn", "longrope")}
TOP_LEVEL_KEYS = set(ENTRIES) | {"rope_type", "truncate"}


class HFRopeError(UserError, ValueError):
    """A RoPE setting of an HF config that transformers computes differently or not at all; names the key."""


def _entry_scaling(entry: dict, truncate: bool, where: str) -> tuple[float, float, RopeScaling]:
    """One layer type's entry -> (rope_theta, partial_rotary_factor, RopeScaling)."""
    kind = entry.get("rope_type", entry.get("type", "default"))
    if kind not in ROPE_TYPE_KEYS:
        raise HFRopeError(f"{where}.rope_type={kind!r} is not supported (zaya_jax computes {tuple(ROPE_TYPE_KEYS)})")
    used = ROPE_TYPE_KEYS[kind]
    for key, value in entry.items():
        if key in ("rope_type", "type", "rope_theta", "partial_rotary_factor") or value is None:
            continue
        if key not in used:
            raise HFRopeError(f"{where}.{key}={value!r} is not read with rope_type {kind!r} (transformers ignores it; "
                              f"that type reads {used or 'no other key'}); remove it")
        if key == "truncate" and value != truncate:
            raise HFRopeError(f"{where}.truncate={value!r} is not what transformers reads: its yarn takes "
                              f"rope_parameters['truncate'] (here {truncate}) for every layer type; move it there")
    for key in ("rope_theta", *REQUIRED.get(kind, ())):
        if key not in entry:
            raise HFRopeError(f"{where}.{key} is missing (rope_type {kind!r} needs it; transformers refuses the "
                              "config)")
    values: dict[str, Any] = {"rope_type": kind}
    for key in used:
        value = truncate if key == "truncate" else entry.get(key)
        if value is None:
            if kind in DERIVED_WHEN_NULL.get(key, ()):
                values[key] = 0.0  # derived, as transformers derives it from null
            elif key in REQUIRED.get(kind, ()):
                raise HFRopeError(f"{where}.{key} is null; rope_type {kind!r} computes with a number there")
            continue  # otherwise transformers' own default (beta_fast 32, ...) is RopeScaling's
        if key in ("factor", "attention_factor") and not (isinstance(value, (int, float)) and value > 0):
            raise HFRopeError(f"{where}.{key}={value!r} must be a positive number (null: derived from the others)")
        if key in ("beta_fast", "beta_slow") and not value:
            continue  # transformers: `get(key) or 32` / `or 1`
        values[key] = value
    scaling = RopeScaling(**values)
    theta, partial = entry["rope_theta"], entry.get("partial_rotary_factor", 1.0)
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        raise HFRopeError(f"{where}.rope_theta={theta!r} must be a positive number")
    return float(theta), float(partial), scaling


def rope_fields_from_hf(hf: dict, layer_types: list[str], head_dim: int, prefix: str = "") -> dict[str, Any]:
    """The RoPE fields of ModelConfig (rope_theta, sliding_rope_theta, rope_scaling,
    sliding_rope_scaling, partial_rotary_factor) from a ZAYA text config dict; prefix: where that dict
    sits in config.json ("text_config." in a zaya1_vl one)."""
    where = f"config.json: {prefix}rope_parameters"
    if hf.get("rope_scaling") is not None:
        raise HFRopeError(f"config.json: {prefix}rope_scaling is transformers' old name for rope_parameters (its "
                          f"setter replaces rope_parameters with it); write it as {prefix}rope_parameters")
    ropes = hf.get("rope_parameters")
    ropes = ZAYA_DEFAULTS if ropes is None else ropes
    if not isinstance(ropes, dict):
        raise HFRopeError(f"{where} must map layer types to their RoPE settings, got {ropes!r}")
    extra = sorted(set(ropes) - TOP_LEVEL_KEYS)
    if extra:
        raise HFRopeError(f"{where}.{extra[0]}: transformers' ZAYA reads only the entries {tuple(ENTRIES)} (and "
                          "'truncate') there; move the setting into an entry")
    if ropes.get("rope_type", "default") != "default":
        raise HFRopeError(f"{where}.rope_type={ropes['rope_type']!r} at the top level is deleted unread by "
                          "transformers' ZayaConfig; put the scaling in rope_parameters.hybrid (and .hybrid_sliding)")
    truncate = ropes.get("truncate", True)
    if not isinstance(truncate, bool):
        raise HFRopeError(f"{where}.truncate={truncate!r} must be true or false")
    fields, partial = {}, {}
    for layer_type, (theta_field, scaling_field) in ENTRIES.items():
        entry = ropes.get(layer_type)
        if entry is None and layer_type in layer_types:
            raise HFRopeError(f"{where}.{layer_type} is missing: the config has {layer_type!r} layers")
        entry = ZAYA_DEFAULTS[layer_type] if entry is None else entry
        if not isinstance(entry, dict):
            raise HFRopeError(f"{where}.{layer_type} must be a mapping of RoPE settings, got {entry!r}")
        fields[theta_field], partial[layer_type], fields[scaling_field] = _entry_scaling(
            entry, truncate, f"{where}.{layer_type}")
    if "hybrid_sliding" in layer_types and partial["hybrid_sliding"] != partial["hybrid"]:
        raise HFRopeError(f"{where}: the 'hybrid' and 'hybrid_sliding' entries give different partial_rotary_factor "
                          "values; zaya_jax rotates the same dims in both")
    fields["partial_rotary_factor"] = partial["hybrid" if "hybrid" in layer_types else "hybrid_sliding"]
    rotary_dim = int(head_dim * fields["partial_rotary_factor"])
    for layer_type, (_, scaling_field) in ENTRIES.items():
        validate_rope_scaling(fields[scaling_field], f"{where}.{layer_type}", rotary_dim)
    return fields


def _entry_to_hf(theta: float, scaling: RopeScaling, partial: float) -> dict[str, Any]:
    entry = {"rope_type": scaling.rope_type, "rope_theta": theta, "partial_rotary_factor": partial}
    for key in scaling.used_keys():
        value = getattr(scaling, key)
        if key in ("short_factor", "long_factor"):
            entry[key] = list(value)
        elif value == 0 and key in REQUIRED.get(scaling.rope_type, ()):
            entry[key] = None  # derived, as transformers derives it from null (yarn's factor)
        elif value == 0 and key in ("factor", "attention_factor", "mscale", "mscale_all_dim") or key == "truncate":
            continue  # absent: derived or transformers' null; truncate is read at the top level
        else:
            entry[key] = value
    return entry


def rope_parameters_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """ModelConfig -> transformers' nested rope_parameters (both entries, as rope_fields_from_hf reads them)."""
    ropes = {layer_type: _entry_to_hf(getattr(cfg, theta_field), getattr(cfg, scaling_field), cfg.partial_rotary_factor)
             for layer_type, (theta_field, scaling_field) in ENTRIES.items()}
    scalings = [getattr(cfg, field) for _, field in ENTRIES.values()]
    truncate = {s.truncate for s in scalings if s.rope_type == "yarn"}
    if len(truncate) > 1:
        raise ConfigError("model.rope_scaling.truncate and model.sliding_rope_scaling.truncate differ; transformers' "
                          "ZAYA reads one truncate for every yarn layer type (rope_parameters['truncate']): make them "
                          "equal to export")
    if truncate == {False}:
        ropes["truncate"] = False
    return ropes
