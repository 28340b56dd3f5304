"""HF safetensors <-> Orbax checkpoints.

  python -m zaya_jax.convert to_orbax --hf HF_DIR --out CKPT_DIR [--dtype bfloat16]
  python -m zaya_jax.convert to_hf --checkpoint CKPT_DIR --out HF_DIR [--step N] [--schema native|original]

to_orbax writes a model-only checkpoint (params, balancing biases and the model config, step 0)
in the trainer's layout: point `python -m zaya_jax.evaluate --checkpoint` at it, or copy it to
WORKDIR/checkpoints to fine-tune from it. to_hf reads the `model` item of any checkpoint (a
training run's WORKDIR, its WORKDIR/checkpoints, or a to_orbax output) and writes config.json +
safetensors that `transformers.ZayaForCausalLM.from_pretrained` loads.
"""

from __future__ import annotations

import dataclasses
import os

from absl import app, flags

from zaya_jax.train.checkpoint import load_checkpoint_model, save_model
from zaya_jax.train.state import ModelParts

_HF = flags.DEFINE_string("hf", None, "to_orbax: the HF checkpoint directory to read.")
_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "to_hf: the Orbax checkpoint directory to read.")
_OUT = flags.DEFINE_string("out", None, "The directory to write (must not exist or be empty).")
_STEP = flags.DEFINE_integer("step", None, "to_hf: the checkpoint step (default: the latest).")
_SCHEMA = flags.DEFINE_enum("schema", None, ["native", "original"], "to_hf: HF tensor names (default: by layout).")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "to_orbax: the compute dtype recorded.")


def to_orbax(hf_dir: str, out_dir: str, dtype: str = "float32") -> str:
    import zaya_jax
    if os.path.isdir(out_dir) and os.listdir(out_dir):
        raise FileExistsError(f"{out_dir}: exists and is not empty; refusing to overwrite")
    model = zaya_jax.load_hf(hf_dir, dtype=dtype)
    params, biases = ModelParts.arrays(model)
    save_model(out_dir, params, biases, {"model": dataclasses.asdict(model.config)})
    return out_dir


def to_hf(checkpoint: str, out_dir: str, step: int | None = None, schema: str | None = None) -> str:
    import zaya_jax
    model, _ = load_checkpoint_model(checkpoint, step)
    zaya_jax.save_hf(model, out_dir, schema=schema)
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
        print(f"wrote {to_hf(_CHECKPOINT.value, _OUT.value, _STEP.value, _SCHEMA.value)}")


if __name__ == "__main__":
    app.run(main)
