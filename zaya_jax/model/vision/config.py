"""Validated vision-tower configuration: Qwen2.5-VL's vision transformer as ZAYA1-VL uses it.

Field names are transformers' `Qwen2_5_VLVisionConfig` / `Zaya1VLVisionConfig` names; the defaults
are ZAYA1-VL-8B's (32 blocks of width 1280, full attention in blocks 7, 15, 23 and 31, 14x14
patches of one frame, 2x2 merge to the text width 2048). `VisionConfig.from_hf` reads the HF
`vision_config` dict; a bad field is named before anything is built.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from zaya_jax.config import ConfigError

HF_ACTIVATIONS = ("silu",)  # the SwiGLU MLP's activation (Qwen2.5-VL: hidden_act = "silu")


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    depth: int = 32
    hidden_size: int = 1280
    intermediate_size: int = 3420
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 1
    spatial_merge_size: int = 2
    window_size: int = 112                 # pixels; a window is window_size / patch / merge merged units wide
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)
    out_hidden_size: int = 2048            # the text model's hidden size
    hidden_act: str = "silu"
    rope_theta: float = 10_000.0
    rms_norm_eps: float = 1e-6
    dtype: str = "float32"

    def __post_init__(self):
        object.__setattr__(self, "fullatt_block_indexes", tuple(self.fullatt_block_indexes))
        _validate(self)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Input features of one patch: channels x frames x pixels (the processor's flattening)."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def merge_unit(self) -> int:
        """Patches merged into one text token (2 x 2)."""
        return self.spatial_merge_size ** 2

    @property
    def window_units(self) -> int:
        """A window's side in merged units (ZAYA1-VL: 112 / 14 / 2 = 4)."""
        return self.window_size // self.spatial_merge_size // self.patch_size

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any], **runtime) -> "VisionConfig":
        """transformers' vision_config dict (Qwen2.5-VL / ZAYA1-VL) -> VisionConfig."""
        names = {f.name for f in dataclasses.fields(cls)} - {"rope_theta", "rms_norm_eps", "dtype"}
        fields = {k: v for k, v in hf.items() if k in names}
        rope = hf.get("rope_parameters") or {}
        if "rope_theta" in rope:
            fields["rope_theta"] = float(rope["rope_theta"])
        return cls(**fields, **runtime)


def _validate(c: VisionConfig) -> None:
    for name in ("depth", "hidden_size", "intermediate_size", "num_heads", "in_channels", "patch_size",
                 "temporal_patch_size", "spatial_merge_size", "window_size", "out_hidden_size"):
        value = getattr(c, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"vision.{name} must be a positive integer, got {value!r}")
    if c.hidden_size % c.num_heads or c.head_dim % 4:
        raise ConfigError(f"vision.hidden_size ({c.hidden_size}) / vision.num_heads ({c.num_heads}) must be a "
                          "head width divisible by 4 (the 2D rotary embedding rotates height and width halves)")
    if c.window_size % (c.patch_size * c.spatial_merge_size):
        raise ConfigError(f"vision.window_size ({c.window_size}) must be a multiple of patch_size x "
                          f"spatial_merge_size ({c.patch_size * c.spatial_merge_size})")
    bad = [i for i in c.fullatt_block_indexes if not 0 <= i < c.depth]
    if bad:
        raise ConfigError(f"vision.fullatt_block_indexes {bad} lie outside the {c.depth} blocks")
    if c.hidden_act not in HF_ACTIVATIONS:
        raise ConfigError(f"vision.hidden_act={c.hidden_act!r} is not supported; choose one of {HF_ACTIVATIONS}")
    if c.dtype not in ("float32", "bfloat16"):
        raise ConfigError(f"vision.dtype={c.dtype!r} does not exist; choose float32 or bfloat16")
