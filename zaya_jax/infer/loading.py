"""Loading a model for inference, optionally quantized on the way in.

  load_hf(dir)          an HF ZAYA checkpoint (config.json + safetensors)
  load_checkpoint(dir)  a training run's Orbax checkpoint (zaya_jax.checkpoints.orbax_checkpoint): the saved
                        run config gives the model; the `model` item gives weights and biases,
                        restored onto this process's first device whatever mesh wrote them
  tokenizer_for(...)    the tokenizer.json that goes with either
  load_model(...)       either one as a CLI names it (--checkpoint or --hf, a zaya1_vl HF directory
                        included), a ZayaLM or a ZayaVL
  model_image_processor(...)  the image processor a vision-language model's config records (None
                        for a text model), read before any weights
"""

from __future__ import annotations

import os

from zaya_jax.checkpoints import hf_load
from zaya_jax.checkpoints.carried_tokenizer import checkpoint_tokenizer
from zaya_jax.checkpoints.hf_load import read_hf_config
from zaya_jax.checkpoints.hf_vl import load_vl_hf, load_vl_processor
from zaya_jax.checkpoints.orbax_checkpoint import checkpoint_dir, load_checkpoint_model, read_config
from zaya_jax.checkpoints.quantize import quantize_model
from zaya_jax.data.vision.processor import image_processor
from zaya_jax.errors import UserError
from zaya_jax.model.zaya import ZayaLM


def _maybe_quantize(model: ZayaLM, quantize: str | None, group_size: int) -> ZayaLM:
    return model if quantize is None else quantize_model(model, quantize, group_size)


def load_hf(path: str | os.PathLike, *, dtype: str = "float32", quantize: str | None = None,
            group_size: int = 64, **overrides) -> ZayaLM:
    """An HF ZAYA checkpoint directory -> ZayaLM for generation.

    quantize: None, "int8" or "int4": weight-only, group-wise along the input axis
    (`group_size` entries per scale) for the experts and attention projections
    (zaya_jax.checkpoints.quantize). dtype and overrides as zaya_jax.load_hf.
    """
    return _maybe_quantize(hf_load.load_hf(path, dtype=dtype, **overrides), quantize, group_size)


def load_checkpoint(directory: str | os.PathLike, *, step: int | None = None, quantize: str | None = None,
                    group_size: int = 64, **overrides) -> ZayaLM:
    """A training checkpoint (a run's WORKDIR or its checkpoint directory; default: the latest step) ->
    ZayaLM (a vision-language run's: ZayaVL) on this process's first device, whatever mesh and device
    count wrote it.

    overrides set ModelConfig fields of the saved config (dtype, moe_backend, ...).
    """
    model, _ = load_checkpoint_model(os.fspath(directory), step, **overrides)
    if quantize is not None and not isinstance(model, ZayaLM):
        raise UserError(f"--quantize: {os.fspath(directory)} holds a vision-language model; quantization is for "
                        "text models")
    return _maybe_quantize(model, quantize, group_size)


def tokenizer_for(*, checkpoint: str | None = None, hf: str | None = None, step: int | None = None,
                  given: str | None = None) -> tuple[str, str | None]:
    """(the tokenizer file for a model, one line saying which it is, None when it is `given` for an
    HF directory: the user named it). A checkpoint: the copy it
    carries of the file its run was trained with (zaya_jax.checkpoints.carried_tokenizer; `given`, the
    --tokenizer flag, only when it is that file). An HF directory: `given`, else DIR/tokenizer.json
    (what `convert to_hf` writes). UserError naming the input and the fix when there is none."""
    if checkpoint is not None:
        return checkpoint_tokenizer(checkpoint, step, given)
    if given is not None:
        return given, None
    read_hf_config(hf)  # a directory that is no HF export is named before its tokenizer
    path = os.path.join(hf, "tokenizer.json")
    if not os.path.isfile(path):
        raise UserError(f"--hf {hf} holds no tokenizer.json: pass --tokenizer FILE (or --prompt_ids)")
    return path, f"[tokenizer: {path}]"


def check_block_axis_source(mxfp4_block_axis: str | None, hf: str | None) -> None:
    """A CLI's --mxfp4_block_axis goes with --hf: UserError when it is given without one."""
    if mxfp4_block_axis is not None and hf is None:
        raise UserError(f"--mxfp4_block_axis {mxfp4_block_axis}: goes with --hf (an MXFP4 HF checkpoint); drop it")


def load_model(*, checkpoint: str | None = None, hf: str | None = None, step: int | None = None,
               quantize: str | None = None, group_size: int = 64, mxfp4_block_axis: str | None = None, **overrides):
    """The model a CLI's --checkpoint (with --step) or --hf names -> ZayaLM, or ZayaVL for a
    vision-language run or a zaya1_vl HF directory (then --quantize is refused: it is for text
    models). overrides (dtype, ...) as load_hf / load_checkpoint, mxfp4_block_axis as load_hf's
    (--hf only)."""
    check_block_axis_source(mxfp4_block_axis, hf)
    if hf is not None:
        if read_hf_config(hf).get("model_type") == "zaya1_vl":
            if quantize is not None:
                raise UserError(f"--quantize: {hf} is a zaya1_vl checkpoint; quantization is for text models")
            return load_vl_hf(hf, mxfp4_block_axis=mxfp4_block_axis,
                              **{k: v for k, v in overrides.items() if k == "dtype"})
        return load_hf(hf, quantize=quantize, group_size=group_size, mxfp4_block_axis=mxfp4_block_axis, **overrides)
    return load_checkpoint(checkpoint, step=step, quantize=quantize, group_size=group_size, **overrides)


def model_image_processor(*, checkpoint: str | None = None, hf: str | None = None, step: int | None = None):
    """The ImageProcessor of the model a CLI's --checkpoint or --hf names, read from its config before
    any weights load: a vision-language run's (its vision section: the sizes its images were
    prepared with) or a zaya1_vl HF directory's (its preprocessor_config.json); None for a text model."""
    if hf is not None:
        if read_hf_config(hf).get("model_type") != "zaya1_vl":
            return None
        return load_vl_processor(hf)
    config = read_config(checkpoint_dir(checkpoint), step)
    return image_processor(config) if "vision" in config else None
