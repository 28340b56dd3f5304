"""Held-out loss and perplexity per data source, for a checkpoint or HF weights (for a
train.objective=dpo config: the held-out DPO loss, reward accuracy and margin, against the
reference model saved in the DPO run's checkpoint).

  python -m zaya_jax.evaluate --checkpoint runs/demo [--step N] [--config configs/demo.py]
  python -m zaya_jax.evaluate --hf HF_DIR --config configs/demo.py [--config.mesh.data=...]

--checkpoint takes a training WORKDIR, its checkpoints/ directory, or a `convert to_orbax` output;
without --config it uses the config saved with the checkpoint. The held-out batches are those of
the training run (zaya_jax.train.data.eval_batches: each source's held-out split, or synthetic
held-out batches), scored with the RoPE base of the curriculum phase the checkpoint's step was in
(--rope_theta overrides; for --hf the model config's). Held-out data prepared with another tokenizer
than the one the checkpoint carries (the file its run was trained with) is refused. A
vision-language run's checkpoint is scored on its held-out image_chat rows (the tower on their
images). An FP8 or MXFP4 HF checkpoint (its quantization_config) is scored on its quantized values,
expanded to float on the mesh. Prints one JSON object.

The weights are restored onto this process's mesh whatever mesh wrote them. Without --config,
when the saved config's mesh does not fit this process's device count (a checkpoint trained on
8 devices, evaluated on 1), the evaluation runs data parallel over all devices here instead.
"""

from __future__ import annotations

import json
import sys

import jax
from absl import app, flags, logging
from flax import nnx
from ml_collections import config_flags

from zaya_jax import cli
from zaya_jax.checkpoints.carried_tokenizer import check_prepared_sources
from zaya_jax.checkpoints.hf_quantized import BLOCK_AXES, BLOCK_AXIS_HELP
from zaya_jax.checkpoints.model_parts import ModelParts
from zaya_jax.checkpoints.orbax_checkpoint import checkpoint_dir, model_target, read_config, restore_model
from zaya_jax.checkpoints.quantize import dequantize_model
from zaya_jax.errors import UserError
from zaya_jax.infer.loading import check_block_axis_source
from zaya_jax.parallel import distributed
from zaya_jax.parallel.mesh import make_mesh, resolve_mesh_shape
from zaya_jax.parallel.rules import to_shardings
from zaya_jax.train.data import eval_batches, phase_at_step, phases_of
from zaya_jax.train.loop import evaluate_params
from zaya_jax.train.objectives import make_objective
from zaya_jax.train.settings import settings_from_config
from zaya_jax.train.start_checks import load_hf_matching
from zaya_jax.train.step import jit_eval_step
from zaya_jax.model.vision.vl import build_model

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file (default: the checkpoint's own).")
_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "Orbax checkpoint (WORKDIR, WORKDIR/checkpoints, to_orbax).")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).")
_HF = flags.DEFINE_string("hf", None, "HF checkpoint directory (config.json + safetensors).")
_ROPE_THETA = flags.DEFINE_float("rope_theta", None, "RoPE base to evaluate with.")
_MXFP4_BLOCK_AXIS = flags.DEFINE_enum("mxfp4_block_axis", None, list(BLOCK_AXES), BLOCK_AXIS_HELP)


def evaluation_mesh_sizes(saved: dict[str, int], from_checkpoint: bool) -> dict[str, int]:
    """The mesh to evaluate on: the config's, or for a checkpoint's own config whose mesh needs
    another device count, data parallel over this process's devices."""
    try:
        resolve_mesh_shape(saved, jax.device_count())
        return saved
    except ValueError as err:
        if not from_checkpoint:
            raise
        logging.warning("the checkpoint's mesh does not fit here (%s): evaluating data parallel over %d devices",
                        err, jax.device_count())
        return {"data": -1}


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if bool(_CHECKPOINT.value) == bool(_HF.value):
        raise app.UsageError("give exactly one of --checkpoint and --hf")
    distributed.initialize()

    if _CONFIG.value is None and _HF.value:
        raise app.UsageError("--hf needs --config (it names the evaluation data and the mesh)")
    check_block_axis_source(_MXFP4_BLOCK_AXIS.value, _HF.value)
    config = _CONFIG.value if _CONFIG.value is not None else read_config(checkpoint_dir(_CHECKPOINT.value), _STEP.value)
    if "train" not in config:
        raise UserError(f"--checkpoint {_CHECKPOINT.value}: a model-only checkpoint (convert to_orbax) names no "
                        "evaluation data; pass --config FILE, e.g. --config configs/demo.py")
    settings = settings_from_config(config)
    objective = make_objective(settings)
    if objective.needs_reference and _HF.value:
        raise UserError("--hf with train.objective=dpo: HF weights hold no reference model; evaluate the DPO "
                        "run's --checkpoint, or pass --config.train.objective=lm for the held-out nll")
    if settings.vision is not None and _HF.value:
        raise UserError("--hf with a config that has a vision section: evaluate a vision-language run's "
                        "--checkpoint (HF zaya1_vl weights: convert to_orbax them first)")
    if _CHECKPOINT.value and settings.train.data != "synthetic" and settings.train.objective != "grpo":
        note = check_prepared_sources(_CHECKPOINT.value, _STEP.value, config.data)
        if note:
            print(note, file=sys.stderr)
    mesh = make_mesh(evaluation_mesh_sizes(settings.mesh.sizes, from_checkpoint=_CONFIG.value is None))
    abstract = nnx.eval_shape(lambda: build_model(settings.model, settings.vision, rngs=nnx.Rngs(0)))  # or a ZayaVL
    parts = ModelParts(abstract)
    shardings = {"params": to_shardings(parts.param_specs(mesh), mesh),
                 "biases": jax.sharding.NamedSharding(mesh, parts.biases_spec(mesh))}
    if _HF.value:
        hf_model = load_hf_matching(_HF.value, settings.model, "--hf", _MXFP4_BLOCK_AXIS.value)
        params, biases = ModelParts.arrays(dequantize_model(hf_model))  # an FP8 / MXFP4 export: its values, in float
        model = jax.device_put({"params": params, "biases": biases}, shardings)
        step, rope_theta = None, hf_model.config.rope_theta  # the RoPE base it was exported with
    else:
        target = model_target(abstract, shardings)
        model, step = restore_model(checkpoint_dir(_CHECKPOINT.value), target, _STEP.value)
        rope_theta = phase_at_step(phases_of(config, settings), step).rope_theta
    rope_theta = _ROPE_THETA.value or rope_theta
    reference = None
    if objective.needs_reference:
        reference, _ = restore_model(checkpoint_dir(_CHECKPOINT.value), target, step, item="reference")
    eval_step = jit_eval_step(shardings["params"], shardings["biases"], mesh,
                              None if reference is None else shardings, parts=parts,
                              loss_chunk=settings.train.loss_chunk_size, objective=objective)
    results = evaluate_params(eval_step, model["params"], model["biases"], eval_batches(config, settings), mesh,
                              rope_theta, reference=reference, objective=objective)
    print(json.dumps({"checkpoint": _CHECKPOINT.value, "hf": _HF.value, "step": step, "rope_theta": rope_theta,
                      "results": results}, indent=2))


if __name__ == "__main__":
    cli.run(main)
