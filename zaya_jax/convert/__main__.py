"""HF safetensors <-> Orbax checkpoints.

  python -m zaya_jax.convert to_orbax --hf HF_DIR --out CKPT_DIR [--dtype bfloat16]
  python -m zaya_jax.convert to_hf --checkpoint runs/demo --out HF_DIR [--step N] [--schema native|original]
                                   [--tokenizer FILE]

to_orbax writes a model-only checkpoint (params, balancing biases and the model config, step 0)
in the trainer's layout: point `python -m zaya_jax.evaluate --checkpoint` at it, or copy it to
WORKDIR/checkpoints to fine-tune from it. to_hf reads the `model` item of any checkpoint (a
training run's WORKDIR, its WORKDIR/checkpoints, or a to_orbax output), with the RoPE base of
the curriculum phase it was saved in, and writes config.json + safetensors.

to_hf writes what `transformers.ZayaForCausalLM.from_pretrained` loads (the native schema),
and only when the written files compute the same model: they are read back and their logits
compared with the checkpoint's on a probe batch before the directory appears. A base-layout
model (skip slot passes p * x; transformers outputs 0 there) is written as native only when no
token can reach its skip slot; otherwise to_hf refuses and says why. `--schema original` writes
Zyphra's ZAYA1-base names instead (zaya_jax.load_hf reads them; transformers cannot).
Beside the weights, to_hf writes the run's tokenizer (the copy the checkpoint carries of the file
its run was trained with, zaya_jax.train.carried_tokenizer; a --tokenizer that is another file is
refused; a checkpoint saved before checkpoints carried one: --tokenizer FILE, else its
data.tokenizer, said to be unverified) as tokenizer.json + tokenizer_config.json, with the chat
template a chat or preference run recorded (zaya_jax.convert.hf_tokenizer), so that transformers'
AutoTokenizer encodes and renders chats as the run did; a run without one (synthetic data, a
to_orbax output) or with a SentencePiece model exports the weights alone and says so.
"""

from __future__ import annotations

import dataclasses
import os

import sys

from absl import app, flags

from zaya_jax import cli
from zaya_jax.convert.export_check import schema_problem
from zaya_jax.convert.hf_save import OutputExistsError
from zaya_jax.errors import UserError
from zaya_jax.train.checkpoint import load_checkpoint_model, save_model
from zaya_jax.train.state import ModelParts

_HF = flags.DEFINE_string("hf", None, "to_orbax: the HF checkpoint directory to read.")
_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "to_hf: the Orbax checkpoint directory to read.")
_OUT = flags.DEFINE_string("out", None, "The directory to write (must not exist or be empty).")
_STEP = flags.DEFINE_integer("step", None, "to_hf: the checkpoint step (default: the latest).")
_SCHEMA = flags.DEFINE_enum("schema", None, ["native", "original"],
                            "to_hf: native (transformers; the default) or original (Zyphra's ZAYA1-base names, "
                            "which transformers cannot load).")
_TOKENIZER = flags.DEFINE_string("tokenizer", None, "to_hf: the tokenizer.json to write beside the weights "
                                 "(default: the one the run was trained with).")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "to_orbax: the compute dtype recorded.")


def to_orbax(hf_dir: str, out_dir: str, dtype: str = "float32") -> str:
    import zaya_jax
    if os.path.isdir(out_dir) and os.listdir(out_dir):
        raise OutputExistsError(f"--out {out_dir}: exists and is not empty; choose a new directory")
    from zaya_jax.convert.hf_load import read_hf_config
    if read_hf_config(hf_dir).get("model_type") == "zaya1_vl":
        from zaya_jax.convert.hf_vl import load_vl_hf, load_vl_processor
        model = load_vl_hf(hf_dir, dtype=dtype)
        config = {"model": dataclasses.asdict(model.text.config),
                  "vision": vision_values(model, load_vl_processor(hf_dir))}
    else:
        model = zaya_jax.load_hf(hf_dir, dtype=dtype)
        config = {"model": dataclasses.asdict(model.config)}
    params, biases = ModelParts.arrays(model)
    save_model(out_dir, params, biases, config)
    return out_dir


def vision_values(model, processor) -> dict:
    """A ZayaVL's `vision` config section (config_files.vision_section's fields: its tower, image
    ids and `processor`'s resize bounds) as JSON values."""
    from zaya_jax.config_files import PROCESSOR_FIELDS, VISION_ID_FIELDS, vision_section
    tower = {k: v for k, v in dataclasses.asdict(model.vision.config).items() if k != "dtype"}
    tower["fullatt_block_indexes"] = list(tower["fullatt_block_indexes"])
    sizes = {name: getattr(processor, name) for name in PROCESSOR_FIELDS}
    return vision_section(**tower, **dict(zip(VISION_ID_FIELDS, model.ids)), **sizes).to_dict()


def export_tokenizer(checkpoint: str, step: int | None, cfg, tokenizer_path: str | None) -> tuple[dict[str, str], str]:
    """-> (the tokenizer files to write beside the weights, a line saying what they are or why
    there are none). The tokenizer is the one checkpoint `step` carries (carried_tokenizer; a
    --tokenizer that is another file is refused), for a checkpoint without one --tokenizer or its
    run's data.tokenizer."""
    from zaya_jax.convert.hf_tokenizer import tokenizer_files
    from zaya_jax.data.tokenizer import Tokenizer
    from zaya_jax.infer.chat import checkpoint_chat_template
    from zaya_jax.train.carried_tokenizer import NoTokenizer, checkpoint_tokenizer
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
          tokenizer_path: str | None = None) -> str:
    """Writes the checkpoint's model (fp32) and its tokenizer as an HF directory; `schema` None:
    native, which transformers loads, refused (UserError) when it would change what the model computes."""
    import zaya_jax
    from zaya_jax.vision.model import ZayaVL
    model, loaded_step = load_checkpoint_model(checkpoint, step, dtype="float32")
    if isinstance(model, ZayaVL):
        return vl_to_hf(checkpoint, loaded_step, model, out_dir, schema, tokenizer_path)
    if schema is None:
        problem = schema_problem(model, "native")
        if problem:
            raise UserError(f"--checkpoint {checkpoint}: not exported: {problem}.\nTrain with "
                            "--config.model.layout=native, or pass --schema original for Zyphra's original names "
                            "(zaya_jax.load_hf reads them; transformers cannot).")
        schema = "native"
    files, told = export_tokenizer(checkpoint, step, model.config, tokenizer_path)
    zaya_jax.save_hf(model, out_dir, schema=schema, extra_files=files,
                     report=lambda line: print(line, file=sys.stderr))
    print(told, file=sys.stderr)
    if schema == "original":
        print("note: the original schema holds Zyphra's ZAYA1-base names: zaya_jax.load_hf reads it, "
              "transformers' ZayaForCausalLM cannot", file=sys.stderr)
    return out_dir


def vl_to_hf(checkpoint: str, step: int | None, model, out_dir: str, schema: str | None,
             tokenizer_path: str | None) -> str:
    """A vision-language run's checkpoint as a zaya1_vl HF directory (its native names only), with the
    image processor its run prepared its images with (the config's vision.min_pixels / max_pixels)."""
    from zaya_jax.config_files import image_processor
    from zaya_jax.convert.hf_vl import save_vl_hf
    from zaya_jax.train.checkpoint import checkpoint_dir, read_config
    if schema not in (None, "native"):
        raise UserError(f"--schema {schema}: --checkpoint {checkpoint} holds a vision-language model, which exports "
                        "as transformers' zaya1_vl (native names) only: drop --schema")
    files, told = export_tokenizer(checkpoint, step, model.text.config, tokenizer_path)
    processor = image_processor(read_config(checkpoint_dir(checkpoint), step))
    save_vl_hf(model, out_dir, report=lambda line: print(line, file=sys.stderr), extra_files=files,
               processor=processor)
    print(told, file=sys.stderr)
    return out_dir


def main(argv):
    if len(argv) != 2 or argv[1] not in ("to_orbax", "to_hf"):
        raise app.UsageError("usage: python -m zaya_jax.convert to_orbax --hf DIR --out DIR | "
                             "to_hf --checkpoint DIR --out DIR")
    if not _OUT.value:
        raise app.UsageError("--out is required")
    if argv[1] == "to_orbax":
        if not _HF.value:
            raise app.UsageError("to_orbax needs --hf")
        print(f"wrote {to_orbax(_HF.value, _OUT.value, _DTYPE.value)}")
    else:
        if not _CHECKPOINT.value:
            raise app.UsageError("to_hf needs --checkpoint")
        print(f"wrote {to_hf(_CHECKPOINT.value, _OUT.value, _STEP.value, _SCHEMA.value, _TOKENIZER.value)}")


if __name__ == "__main__":
    cli.run(main)
