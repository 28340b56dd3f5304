"""The conversions `python -m zaya_jax.convert` runs, as functions (see its docstring for what each
writes): to_orbax (HF directory -> model-only Orbax checkpoint), to_hf / vl_to_hf (checkpoint ->
HF directory with its tokenizer and, for ZAYA1-VL, its image processor)."""

from __future__ import annotations

import dataclasses
import os
import sys

from zaya_jax.checkpoints.carried_tokenizer import NoTokenizer, checkpoint_tokenizer
from zaya_jax.checkpoints.export_check import schema_problem
from zaya_jax.checkpoints.hf_load import load_hf, read_hf_config
from zaya_jax.checkpoints.hf_save import OutputExistsError, save_hf
from zaya_jax.checkpoints.hf_vl import load_vl_hf, load_vl_processor, save_vl_hf
from zaya_jax.checkpoints.model_parts import ModelParts
from zaya_jax.checkpoints.orbax_checkpoint import checkpoint_dir, load_checkpoint_model, read_config, save_model
from zaya_jax.checkpoints.quantize import dequantize_model
from zaya_jax.config_files import PROCESSOR_FIELDS, VISION_ID_FIELDS, vision_section
from zaya_jax.convert.hf_tokenizer import tokenizer_files
from zaya_jax.data.tokenizer import Tokenizer
from zaya_jax.errors import UserError
from zaya_jax.infer.chat import checkpoint_chat_template
from zaya_jax.data.vision.processor import image_processor
from zaya_jax.model.vision.vl import is_vision_language


def to_orbax(hf_dir: str, out_dir: str, dtype: str = "float32", mxfp4_block_axis: str | None = None) -> str:
    """An HF directory (a quantized one's weights dequantized to float32, as the trainer holds them;
    mxfp4_block_axis as load_hf's) -> a model-only Orbax checkpoint."""
    if os.path.isdir(out_dir) and os.listdir(out_dir):
        raise OutputExistsError(f"--out {out_dir}: exists and is not empty; choose a new directory")
    if read_hf_config(hf_dir).get("model_type") == "zaya1_vl":
        model = dequantize_model(load_vl_hf(hf_dir, dtype=dtype, mxfp4_block_axis=mxfp4_block_axis))
        config = {"model": dataclasses.asdict(model.text.config),
                  "vision": vision_values(model, load_vl_processor(hf_dir))}
    else:
        model = dequantize_model(load_hf(hf_dir, dtype=dtype, mxfp4_block_axis=mxfp4_block_axis))
        config = {"model": dataclasses.asdict(model.config)}
    params, biases = ModelParts.arrays(model)
    save_model(out_dir, params, biases, config)
    return out_dir


def vision_values(model, processor) -> dict:
    """A ZayaVL's `vision` config section (config_files.vision_section's fields: its tower, image
    ids and `processor`'s resize bounds) as JSON values."""
    tower = {k: v for k, v in dataclasses.asdict(model.vision.config).items() if k != "dtype"}
    tower["fullatt_block_indexes"] = list(tower["fullatt_block_indexes"])
    sizes = {name: getattr(processor, name) for name in PROCESSOR_FIELDS}
    return vision_section(**tower, **dict(zip(VISION_ID_FIELDS, model.ids)), **sizes).to_dict()


def export_tokenizer(checkpoint: str, step: int | None, cfg, tokenizer_path: str | None) -> tuple[dict[str, str], str]:
    """-> (the tokenizer files to write beside the weights, a line saying what they are or why
    there are none). The tokenizer is the one checkpoint `step` carries (carried_tokenizer; a
    --tokenizer that is another file is refused), for a checkpoint without one --tokenizer or its
    run's data.tokenizer."""
    try:
        tokenizer_path, told = checkpoint_tokenizer(checkpoint, step, tokenizer_path)
    except NoTokenizer as err:
        return {}, f"note: no tokenizer written ({err})"
    print(told, file=sys.stderr)
    tokenizer = Tokenizer(tokenizer_path, bos_id=cfg.bos_token_id, eos_id=cfg.eos_token_id, pad_id=cfg.pad_token_id)
    if tokenizer.kind != "hf":
        return {}, (f"note: no tokenizer written: {tokenizer_path} is a SentencePiece model; copy it with the "
                    "tokenizer_config.json of its model family")
    template = checkpoint_chat_template(checkpoint)
    chat = f", chat template {template.path}" if template else ""
    return tokenizer_files(tokenizer, cfg, template), f"tokenizer: {tokenizer_path}{chat}"


def to_hf(checkpoint: str, out_dir: str, step: int | None = None, schema: str | None = None,
          tokenizer_path: str | None = None, quantize: str | None = None, block: int = 128) -> str:
    """Writes the checkpoint's model (fp32) and its tokenizer as an HF directory; `schema` None:
    native, which transformers loads, refused (UserError) when it would change what the model computes.
    quantize "fp8" / "mxfp4": its weights as transformers' quantizers write them (save_hf's quantize, block)."""
    if quantize is not None and schema == "original":
        raise UserError(f"--quantize {quantize} --schema original: quantized checkpoints are written with "
                        "transformers' names only: drop --schema")
    model, loaded_step = load_checkpoint_model(checkpoint, step, dtype="float32")
    if is_vision_language(model):
        return vl_to_hf(checkpoint, loaded_step, model, out_dir, schema, tokenizer_path, quantize, block)
    if schema is None:
        problem = schema_problem(model, "native")
        if problem:
            raise UserError(f"--checkpoint {checkpoint}: not exported: {problem}.\nTrain with "
                            "--config.model.layout=native, or pass --schema original for Zyphra's original names "
                            "(zaya_jax.load_hf reads them; transformers cannot).")
        schema = "native"
    files, told = export_tokenizer(checkpoint, step, model.config, tokenizer_path)
    save_hf(model, out_dir, schema=schema, extra_files=files,
                     report=lambda line: print(line, file=sys.stderr), quantize=quantize, block=block)
    print(told, file=sys.stderr)
    if schema == "original":
        print("note: the original schema holds Zyphra's ZAYA1-base names: zaya_jax.load_hf reads it, "
              "transformers' ZayaForCausalLM cannot", file=sys.stderr)
    return out_dir


def vl_to_hf(checkpoint: str, step: int | None, model, out_dir: str, schema: str | None,
             tokenizer_path: str | None, quantize: str | None = None, block: int = 128) -> str:
    """A vision-language run's checkpoint as a zaya1_vl HF directory (its native names only), with the
    image processor its run prepared its images with (the config's vision.min_pixels / max_pixels);
    quantize: its text model's weights as save_vl_hf writes them."""
    if schema not in (None, "native"):
        raise UserError(f"--schema {schema}: --checkpoint {checkpoint} holds a vision-language model, which exports "
                        "as transformers' zaya1_vl (native names) only: drop --schema")
    files, told = export_tokenizer(checkpoint, step, model.text.config, tokenizer_path)
    processor = image_processor(read_config(checkpoint_dir(checkpoint), step))
    save_vl_hf(model, out_dir, report=lambda line: print(line, file=sys.stderr), extra_files=files,
               processor=processor, quantize=quantize, block=block)
    print(told, file=sys.stderr)
    return out_dir
