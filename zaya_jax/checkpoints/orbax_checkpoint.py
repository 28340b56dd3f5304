"""The Orbax checkpoint format of a run: one directory per step, read and written here.

A step directory holds four items (five for a DPO run):
  model   {params, biases}: the fp32 parameters and balancing biases (what evaluate, convert
          to_hf and generation read)
  train   {step, opt_state, controller_state, rng, skipped_steps, nonfinite_streak}
  data    the data iterator's state (grain.checkpoint.CheckpointSave: one JSON per process)
  config  the full run config as JSON; its model section has the rope_theta of the curriculum
          phase being trained, so it rebuilds the model as it was at that step
  reference  train.objective=dpo only: the frozen reference model {params, biases}, so that a
          resume is exact whatever the run was initialised from
`python -m zaya_jax.convert to_orbax` writes model + config only (step 0); training from such a
directory starts from its weights with a fresh optimizer.

Every step directory also holds `zaya_manifest.json` (integrity.py): the size and crc32 of every
file, written into Orbax's temporary directory before Orbax commits the step by renaming it
(sealing.py; every process checksums a share of the files), so there is no instant at which a
committed step lacks its manifest. A step without a valid manifest was not written whole by this
trainer (a copy, another tool, an older zaya_jax). Restores check the items they read against it and fall back to the newest
step that passes, saying which steps they passed over and why: the trainer (zaya_jax.train.checkpoint's
`resume_point`) also moves the damaged newer steps to `<directory>.rejected/` (never deletes them) so that new saves
cannot collide with them; the read-only loaders (`restore_model`, `read_config`,
`load_checkpoint_model`) only read, create nothing, and raise `UserError` naming the directory when
no step passes. A failed asynchronous write is raised by `poll()` at the next step boundary as one
`CheckpointWriteError` line (the trainer's Checkpointer).

Saves are asynchronous (the loop blocks only while device arrays are copied to host; the write
runs in a background thread) and atomic: Orbax writes into `<step>.orbax-checkpoint-tmp-*` and
renames it to `<step>` once every item and the manifest are complete, so a process killed mid-write
leaves only a temporary directory that is never restored (it is removed at the next start), and one
killed after the rename leaves a whole step that the next start resumes from. Restores place
every array onto the shardings of the *current* process's devices, whatever mesh (and however
many devices) saved it (checkpoint reshaping): every restore gives Orbax a target of
ShapeDtypeStructs carrying shardings (Trainer: the run's mesh; `model_target`: any given
shardings, by default this process's first device), never the saved ones, which name devices
that may not exist here ("Topology mismatch").
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import grain
import jax
import ml_collections
import orbax.checkpoint as ocp
from absl import logging
from flax import nnx

from zaya_jax.checkpoints import integrity
from zaya_jax.checkpoints.model_parts import ModelParts
from zaya_jax.checkpoints.sealing import Sealer
from zaya_jax.config_files import model_config, vision_config
from zaya_jax.errors import UserError
from zaya_jax.model.zaya import ZayaLM
from zaya_jax.parallel.rules import with_shardings
from zaya_jax.vision.model import ZayaVL, build_model

# Replicated arrays are written by one replica. Orbax's default (replica-parallel writes) compiles
# a slicing program per device and array shape at the first save: about 0.5 s per parameter
# shape on CPU, all of it blocking the training loop. (Orbax warns about any override, on every
# import of this module: the warning is silenced, the override being the point.)
_verbosity = logging.get_verbosity()
logging.set_verbosity(logging.ERROR)
try:
    ocp.type_handlers.register_type_handler(
        jax.Array, ocp.type_handlers.ArrayHandler(use_replica_parallel=False), override=True)
finally:
    logging.set_verbosity(_verbosity)


def config_json(config: ml_collections.ConfigDict, rope_theta: float | None = None,
                chat_template: dict | None = None, tokenizer: dict | None = None) -> dict:
    """The run config as JSON. `rope_theta` (the RoPE base of the curriculum phase being trained)
    replaces model.rope_theta, so that the saved model section rebuilds the model as it was at
    that step (generate, convert and zaya_jax.infer.load_checkpoint read only that section).
    `chat_template` (ChatTemplate.record() of the template the chat / preference sources were
    prepared with) is kept as the top-level "chat_template" (what `generate --chat` renders with),
    `tokenizer` (RunTokenizer.record() of the file the step carries) as the top-level "tokenizer"."""
    saved = json.loads(config.to_json_best_effort())
    if rope_theta is not None:
        saved["model"]["rope_theta"] = float(rope_theta)
    if chat_template is not None:
        saved["chat_template"] = chat_template
    if tokenizer is not None:
        saved["tokenizer"] = tokenizer
    return saved

def writer(directory: str, max_to_keep: int | None, async_save: bool, sealer: Sealer) -> ocp.CheckpointManager:
    """A manager that writes `directory`, each step sealed with its manifest before Orbax commits it."""
    options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, enable_async_checkpointing=async_save,
                                           cleanup_tmp_directories=True, create=True,
                                           temporary_path_class=sealer.path_class)
    return ocp.CheckpointManager(os.path.abspath(directory), options=options)


def reader(directory: str) -> ocp.CheckpointManager:
    """A manager that only reads `directory` (creates nothing, deletes nothing)."""
    options = ocp.CheckpointManagerOptions(create=False, cleanup_tmp_directories=False)
    return ocp.CheckpointManager(os.path.abspath(directory), options=options)


def model_target(abstract: ZayaLM, shardings: dict | None = None) -> dict:
    """The restore target of the `model` item for `abstract` (a model of ShapeDtypeStructs).

    {params, biases} ShapeDtypeStructs carrying `shardings` (a {params: tree, biases: sharding}
    matching them; default: none, which restore_model places on this process's first device).
    """
    params, biases = ModelParts.arrays(abstract)
    tree = {"params": params, "biases": biases}
    return tree if shardings is None else with_shardings(tree, shardings)


def whole_step(directory: str, items: tuple[str, ...], step: int | None = None) -> int:
    """The newest step of `directory` (or exactly `step`) whose `items` pass their checksums.

    Read-only: logs (absl, warning) every newer step it passes over and why; raises UserError
    naming the directory when it does not exist or no step passes.
    """
    if not os.path.isdir(directory):
        raise UserError(f"no checkpoint at {directory} (give a run's WORKDIR, its WORKDIR/checkpoints, "
                        "or the output of `python -m zaya_jax.convert to_orbax`)")
    found, skipped = integrity.newest_whole_step(directory, items, step)
    for s, why in skipped:
        if found is not None:
            logging.warning("checkpoint %s in %s skipped: %s", s, directory, why)
    if found is None:
        detail = "; ".join(f"step {s}: {why}" for s, why in skipped) or "no step directories"
        if not skipped and os.path.isfile(os.path.join(directory, "config.json")):
            detail += " (it holds an HF checkpoint's config.json: give it as --hf instead)"
        parent, name = os.path.split(os.path.normpath(directory))
        if not skipped and name.isdigit() and int(name) in integrity.steps_in(parent):
            detail += f" (it is a step directory: give --checkpoint {parent} --step {name})"
        saved = integrity.steps_in(directory)
        if step is not None and step not in saved:
            detail += f" (saved steps: {', '.join(map(str, saved)) or 'none'})"
        raise UserError(f"no whole checkpoint at {directory}{f' (step {step})' if step is not None else ''}: {detail}")
    return found


def restore_model(directory: str, target: dict, step: int | None = None, item: str = "model") -> tuple[dict, int]:
    """The `model` item ({params, biases}) of `step` (default: the newest whole one) onto `target`'s shardings;
    item='reference': a DPO run's frozen reference model instead (UserError when the step has none).

    A target leaf without a sharding goes onto this process's first device (Orbax would otherwise
    use the sharding saved in the checkpoint, which fails whenever the saving process had other devices).
    """
    step = whole_step(directory, (item,), step)
    if item not in integrity.items_of(os.path.join(directory, str(step))):
        raise UserError(f"checkpoint {step} in {directory} has no {item} item (only a train.objective=dpo run "
                        "saves its reference model)")
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    target = jax.tree.map(lambda a: a if getattr(a, "sharding", None) is not None
                          else jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device), target)
    manager = reader(directory)
    restored = manager.restore(step, args=ocp.args.Composite(**{item: ocp.args.StandardRestore(target)}))
    manager.close()
    return restored[item], step


def read_config(directory: str, step: int | None = None) -> ml_collections.ConfigDict:
    """The run config saved with a checkpoint (default: the newest whole one)."""
    step = whole_step(directory, ("config",), step)
    manager = reader(directory)
    config = manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore())).config
    manager.close()
    return ml_collections.ConfigDict(config)


class _StateProbe(grain.DatasetIterator):
    """Receives a saved data iterator state (grain's CheckpointRestore calls set_state) and keeps it."""

    def __init__(self):
        super().__init__()
        self.state = None

    def __next__(self):
        raise StopIteration

    def get_state(self):
        return self.state

    def set_state(self, state) -> None:
        self.state = state


def saved_data_state(directory: str, step: int) -> dict | None:
    """This process's data iterator state saved with `step` (a training checkpoint), read without
    restoring anything; None when its `data` item is not whole or holds no state for this process
    (a job of another size saved it)."""
    if integrity.problem(os.path.join(directory, str(step)), ("data",)) is not None:
        return None
    probe, manager = _StateProbe(), reader(directory)
    try:
        manager.restore(step, args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(probe)))
    except ValueError:  # grain: "File .../process_i-of-n.json does not exist."
        return None
    finally:
        manager.close()
    return probe.state


def save_model(directory: str, params: dict, biases: Any, config: dict, step: int = 0) -> None:
    """Writes a model-only checkpoint (params, biases, config) at `step`, synchronously."""
    sealer = Sealer(directory, "model")
    manager = writer(directory, None, False, sealer)
    saving = [True]
    sealer.starting(step, lambda: saving[0])
    manager.save(step, args=ocp.args.Composite(model=ocp.args.StandardSave({"params": params, "biases": biases}),
                                               config=ocp.args.JsonSave(config)), force=True)
    saving[0] = False
    manager.wait_until_finished()
    manager.close()
    errors = sealer.errors(wait=True)
    sealer.close()
    if errors:
        raise errors[0]


def checkpoint_dir(path: str) -> str:
    """A run's WORKDIR or its WORKDIR/checkpoints -> the directory holding the step directories."""
    nested = os.path.join(path, "checkpoints")
    return nested if os.path.isdir(nested) else path


def load_checkpoint_model(path: str, step: int | None = None, **overrides) -> tuple[ZayaLM | ZayaVL, int]:
    """(model, step) from the `model` item and saved config of a checkpoint, on this process's first
    device: a ZayaLM, or the ZayaVL of a vision-language run (its config has a vision section).

    `path`: a checkpoint directory or a run's WORKDIR; `overrides` set ModelConfig fields of the
    saved config (dtype, moe_backend, ...). Works whatever mesh and device count wrote the checkpoint.
    """
    directory = checkpoint_dir(path)
    step = whole_step(directory, ("model", "config"), step)
    config = read_config(directory, step)
    text = model_config(config).replace(**overrides)
    vision = vision_config(config)
    if vision is not None:
        tower, ids = vision
        vision = dataclasses.replace(tower, dtype=text.dtype), ids    # the tower computes in the text model's dtype
    abstract = nnx.eval_shape(lambda: build_model(text, vision, rngs=nnx.Rngs(0)))
    model, step = restore_model(directory, model_target(abstract), step)
    return ModelParts(abstract).merge(model["params"], model["biases"]), step
