"""HF safetensors <-> Orbax checkpoints.

  python -m zaya_jax.convert to_orbax --hf HF_DIR --out CKPT_DIR [--dtype bfloat16] [--mxfp4_block_axis input]
  python -m zaya_jax.convert to_hf --checkpoint runs/demo --out HF_DIR [--step N] [--schema native|original]
                                   [--tokenizer FILE] [--quantize fp8|mxfp4] [--fp8_block 128]

to_orbax writes a model-only checkpoint (params, balancing biases and the model config, step 0)
in the trainer's layout: point `python -m zaya_jax.evaluate --checkpoint` at it, or copy it to
WORKDIR/checkpoints to fine-tune from it. to_hf reads the `model` item of any checkpoint (a
training run's WORKDIR, its WORKDIR/checkpoints, or a to_orbax output), with the RoPE base of
the curriculum phase it was saved in, and writes config.json + safetensors.

to_hf --quantize fp8 | mxfp4 writes the weights as transformers' quantizers write them, with their
quantization_config (zaya_jax.checkpoints.quantized_export): fp8 (FineGrainedFP8Config) the attention
projections and experts in --fp8_block square blocks (the last of an axis partial where they do not
tile it) of e4m3 values and float32 scales, mxfp4 (Mxfp4Config) the experts, blocked along their
output axis (block_axis "output"); router, norms, CCA convolutions and temperatures, the embedding
and the LM head stay in float (a ZAYA1-VL's text model likewise; its vision tower, merger and vision
LoRA stay in float). The read-back check then compares the files, read quantized, with the model
holding the quantized weights' values. An HF directory with such a
quantization_config (either method) is read by to_orbax, generate --hf and the server, its
experts and attention kept quantized in memory (zaya_jax.checkpoints.hf_quantized); an MXFP4 file that
states no block_axis is read as transformers reads it (output), --mxfp4_block_axis input for blocks
along the contraction axis (docs/fp8.md).

to_hf writes what `transformers.ZayaForCausalLM.from_pretrained` loads (the native schema),
and only when the written files compute the same model: they are read back and their logits
compared with the checkpoint's on a probe batch before the directory appears. A base-layout
model (skip slot passes p * x; transformers outputs 0 there) is written as native only when no
token can reach its skip slot; otherwise to_hf refuses and says why. `--schema original` writes
Zyphra's ZAYA1-base names instead (zaya_jax.load_hf reads them; transformers cannot).
Beside the weights, to_hf writes the run's tokenizer (the copy the checkpoint carries of the file
its run was trained with, zaya_jax.checkpoints.carried_tokenizer; a --tokenizer that is another file is
refused; a checkpoint saved before checkpoints carried one: --tokenizer FILE, else its
data.tokenizer, said to be unverified) as tokenizer.json + tokenizer_config.json, with the chat
template a chat or preference run recorded (zaya_jax.convert.hf_tokenizer), so that transformers'
AutoTokenizer encodes and renders chats as the run did; a run without one (synthetic data, a
to_orbax output) or with a SentencePiece model exports the weights alone and says so.
"""

from __future__ import annotations

from absl import app, flags

from zaya_jax import cli
from zaya_jax.convert.conversions import to_hf, to_orbax
from zaya_jax.checkpoints.hf_quantized import BLOCK_AXES, BLOCK_AXIS_HELP

_HF = flags.DEFINE_string("hf", None, "to_orbax: the HF checkpoint directory to read.")
_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "to_hf: the Orbax checkpoint directory to read.")
_OUT = flags.DEFINE_string("out", None, "The directory to write (must not exist or be empty).")
_STEP = flags.DEFINE_integer("step", None, "to_hf: the checkpoint step (default: the latest).")
_SCHEMA = flags.DEFINE_enum("schema", None, ["native", "original"],
                            "to_hf: native (transformers; the default) or original (Zyphra's ZAYA1-base names, "
                            "which transformers cannot load).")
_TOKENIZER = flags.DEFINE_string("tokenizer", None, "to_hf: the tokenizer.json to write beside the weights "
                                 "(default: the one the run was trained with).")
_QUANTIZE = flags.DEFINE_enum("quantize", None, ["fp8", "mxfp4"],
                              "to_hf: write the weights quantized as transformers' FP8 (FineGrainedFP8Config) or "
                              "MXFP4 (Mxfp4Config) quantizers write them.")
_FP8_BLOCK = flags.DEFINE_integer("fp8_block", 128, "to_hf --quantize fp8: the square block of one scale "
                                  "(weight_block_size; where it does not tile a weight, the last block of an axis is partial).")
_MXFP4_BLOCK_AXIS = flags.DEFINE_enum("mxfp4_block_axis", None, list(BLOCK_AXES), "to_orbax " + BLOCK_AXIS_HELP)
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "to_orbax: the compute dtype recorded.")


def main(argv):
    if len(argv) != 2 or argv[1] not in ("to_orbax", "to_hf"):
        raise app.UsageError("usage: python -m zaya_jax.convert to_orbax --hf DIR --out DIR | "
                             "to_hf --checkpoint DIR --out DIR")
    if not _OUT.value:
        raise app.UsageError("--out is required")
    if argv[1] == "to_orbax":
        if not _HF.value:
            raise app.UsageError("to_orbax needs --hf")
        print(f"wrote {to_orbax(_HF.value, _OUT.value, _DTYPE.value, _MXFP4_BLOCK_AXIS.value)}")
    else:
        if not _CHECKPOINT.value:
            raise app.UsageError("to_hf needs --checkpoint")
        if _MXFP4_BLOCK_AXIS.value:
            raise app.UsageError("--mxfp4_block_axis is to_orbax's (how to read an MXFP4 HF checkpoint); to_hf "
                                 "writes MXFP4 blocks along the output axis, as transformers reads them: drop it")
        written = to_hf(_CHECKPOINT.value, _OUT.value, _STEP.value, _SCHEMA.value, _TOKENIZER.value, _QUANTIZE.value,
                        _FP8_BLOCK.value)
        print(f"wrote {written}")


if __name__ == "__main__":
    cli.run(main)
