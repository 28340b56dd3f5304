"""Loading ml_collections config files and turning their sections into validated objects.

A config file defines `get_config()` returning a ConfigDict with sections:
  model    every ModelConfig field (zaya_jax.config), built with `model_section(**values)` so
           that any field can be overridden from the command line (`--config.model.remat=full`)
  kernels  attention, moe_matmul: auto | xla | pallas (the same settings as
           model.attention_kernel and model.moe_matmul_kernel; set either, not both differently)
  train, optimizer, balancing, checkpoint, eval, mesh, monitor
           the trainer's (validated by zaya_jax.train.settings; docs/training.md)
  data     the data curriculum (zaya_jax.data.curriculum; docs/data.md)
  vision   a ZAYA1-VL model's vision tower and image token ids (`vision_section(**values)`;
           docs/vision.md); planned by the planner, trained by zaya_jax.train
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os

import ml_collections

from zaya_jax.config import ROPE_SCALING_FIELDS, ConfigError, ModelConfig, RopeScaling


def load_config_file(path: str | os.PathLike) -> ml_collections.ConfigDict:
    """Imports `path` and returns its `get_config()`; errors name the file."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: config file not found")
    spec = importlib.util.spec_from_file_location(f"zaya_config_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "get_config"):
        raise ConfigError(f"{path}: defines no get_config()")
    return module.get_config()


KERNEL_FIELDS = {"attention": "attention_kernel", "moe_matmul": "moe_matmul_kernel"}  # kernels.* -> model.*


def model_section(**values) -> ml_collections.ConfigDict:
    """A config's `model` section: every ModelConfig field, its default unless given in `values`.

    Listing every field is what lets ml_collections accept `--config.model.<field>=...` for any
    of them, and every key of a RoPE scaling (`--config.model.rope_scaling.factor=4`: a given
    `rope_scaling` dict is completed with RopeScaling's defaults); an int given for a float field is
    stored as a float, so float overrides parse.
    """
    ModelConfig.check_field_names(values)
    section = {**ModelConfig.defaults(), **values}
    for name in ROPE_SCALING_FIELDS:
        given = RopeScaling.from_value(section[name], f"model.{name}")
        section[name] = _floats_where_defaults_are(dataclasses.asdict(given), RopeScaling.defaults())
    return ml_collections.ConfigDict(_floats_where_defaults_are(section, ModelConfig.defaults()))


def _floats_where_defaults_are(values: dict, defaults: dict) -> dict:
    """values with each int whose field defaults to a float made a float."""
    return {name: float(value) if isinstance(defaults.get(name), float) and isinstance(value, int)
            and not isinstance(value, bool) else value for name, value in values.items()}


def model_config(config: ml_collections.ConfigDict) -> ModelConfig:
    """The validated ModelConfig of a full config (model section plus kernel choices).

    A `kernels` entry and its model field are one setting: whichever differs from the default
    applies; both set to different non-default values is an error naming both.
    """
    if "model" not in config:
        raise ConfigError("config has no 'model' section")
    values = dict(config.model.items())
    kernels, defaults = config.get("kernels", {}), ModelConfig.defaults()
    for key, field in KERNEL_FIELDS.items():
        if key not in kernels or kernels[key] == defaults[field]:
            continue
        if values.get(field, defaults[field]) not in (defaults[field], kernels[key]):
            raise ConfigError(f"kernels.{key}={kernels[key]!r} and model.{field}={values[field]!r} are the same "
                              "setting with different values; set one of them")
        values[field] = kernels[key]
    return ModelConfig.from_config(values)


def vision_section(**values) -> ml_collections.ConfigDict:
    """A config's `vision` section (a ZAYA1-VL model): every VisionConfig field, the image token ids
    and the image processor's resize bounds (PROCESSOR_FIELDS: what generation resizes a given image
    to), their defaults (ZAYA1-VL-8B's, Qwen2-VL's processor) unless given in `values`."""
    from zaya_jax.model.vision.config import VisionConfig
    from zaya_jax.model.vision.image_size import MAX_PIXELS, MIN_PIXELS
    from zaya_jax.model.vision.vl import ZAYA1_VL_IDS
    defaults = {f.name: f.default for f in dataclasses.fields(VisionConfig) if f.name != "dtype"}
    defaults["fullatt_block_indexes"] = list(defaults["fullatt_block_indexes"])
    defaults |= dict(zip(VISION_ID_FIELDS, ZAYA1_VL_IDS))
    defaults |= dict(zip(PROCESSOR_FIELDS, (MIN_PIXELS, MAX_PIXELS)))
    unknown = sorted(set(values) - set(defaults))
    if unknown:
        raise ConfigError(f"vision.{unknown[0]}: unknown field (known fields: {', '.join(sorted(defaults))})")
    return ml_collections.ConfigDict({**defaults, **values})


VISION_ID_FIELDS = ("image_token_id", "vision_start_token_id", "vision_end_token_id")
PROCESSOR_FIELDS = ("min_pixels", "max_pixels")


def vision_config(config: ml_collections.ConfigDict):
    """-> (VisionConfig, ImageTokenIds) of a config's `vision` section, or None without one; the
    tower computes in the model's dtype."""
    if "vision" not in config:
        return None
    from zaya_jax.model.vision.config import VisionConfig
    from zaya_jax.model.vision.vl import ImageTokenIds
    values = {k: v for k, v in config.vision.items() if k not in PROCESSOR_FIELDS}
    ids = ImageTokenIds(*(int(values.pop(name)) for name in VISION_ID_FIELDS if name in values))
    try:
        return VisionConfig(**values, dtype=model_config(config).dtype), ids
    except TypeError as err:
        raise ConfigError(f"vision: {err} (build the section with config_files.vision_section)") from err
