"""Orbax checkpoints of a training run: one directory per step under the workdir.

A step directory holds four items:
  model   {params, biases}: the fp32 parameters and balancing biases (what evaluate, convert
          to_hf and generation read)
  train   {step, opt_state, controller_state, rng, skipped_steps, nonfinite_streak}
  data    the data iterator's state (grain.checkpoint.CheckpointSave: one JSON per process)
  config  the full run config as JSON; its model section has the rope_theta of the curriculum
          phase being trained, so it rebuilds the model as it was at that step
`python -m zaya_jax.convert to_orbax` writes model + config only (step 0); training from such a
directory starts from its weights with a fresh optimizer.

Saves are asynchronous (the loop blocks only while device arrays are copied to host; the write
runs in a background thread) and atomic: Orbax writes into `<step>.orbax-checkpoint-tmp-*` and
renames it to `<step>` once every item is complete, so a process killed mid-write leaves only a
temporary directory that is never restored (it is removed at the next start). Restores place
every array onto the shardings of the *current* process's devices, whatever mesh (and however
many devices) saved it (checkpoint reshaping): every restore gives Orbax a target of
ShapeDtypeStructs carrying shardings (Trainer: the run's mesh; `model_target`: any given
shardings, by default this process's first device), never the saved ones, which name devices
that may not exist here ("Topology mismatch").
"""

from __future__ import annotations

import json
import os
from typing import Any

import grain
import jax
import ml_collections
import orbax.checkpoint as ocp
from absl import logging

from zaya_jax.config_files import model_config
from zaya_jax.model.build import abstract_model
from zaya_jax.model.zaya import ZayaLM
from zaya_jax.train.settings import CheckpointSettings
from zaya_jax.train.state import ModelParts, TrainState, with_shardings

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

TRAIN_FIELDS = ("step", "opt_state", "controller_state", "rng", "skipped_steps", "nonfinite_streak")


def config_json(config: ml_collections.ConfigDict, rope_theta: float | None = None) -> dict:
    """The run config as JSON. `rope_theta` (the RoPE base of the curriculum phase being trained)
    replaces model.rope_theta, so that the saved model section rebuilds the model as it was at
    that step (generate, convert and zaya_jax.infer.load_checkpoint read only that section)."""
    saved = json.loads(config.to_json_best_effort())
    if rope_theta is not None:
        saved["model"]["rope_theta"] = float(rope_theta)
    return saved


def _manager(directory: str, max_to_keep: int | None, async_save: bool) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, enable_async_checkpointing=async_save,
                                           cleanup_tmp_directories=True, create=True)
    return ocp.CheckpointManager(os.path.abspath(directory), options=options)


class Checkpointer:
    """Saves and restores TrainStates (plus data-iterator state and config) in `directory`."""

    def __init__(self, directory: str, settings: CheckpointSettings):
        self.directory = os.path.abspath(directory)
        self._manager = _manager(self.directory, settings.max_to_keep, settings.async_save)

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def has_train_state(self, step: int) -> bool:
        return os.path.isdir(os.path.join(self.directory, str(step), "train"))

    def save(self, state: TrainState, data_iterator: grain.DatasetIterator, config: dict) -> int:
        """Starts saving `state` at its step; returns the step. Blocks only for the device-to-host copy."""
        step = int(jax.device_get(state.step))
        args = ocp.args.Composite(
            model=ocp.args.StandardSave({"params": state.params, "biases": state.biases}),
            train=ocp.args.StandardSave({f: getattr(state, f) for f in TRAIN_FIELDS}),
            data=grain.checkpoint.CheckpointSave(data_iterator),
            config=ocp.args.JsonSave(config))
        self._manager.save(step, args=args, force=True)
        return step

    def restore(self, step: int, target: TrainState, data_iterator: grain.DatasetIterator) -> TrainState:
        """`target`: a TrainState of ShapeDtypeStructs with the shardings to restore onto."""
        restored = self._manager.restore(step, args=ocp.args.Composite(
            model=ocp.args.StandardRestore({"params": target.params, "biases": target.biases}),
            train=ocp.args.StandardRestore({f: getattr(target, f) for f in TRAIN_FIELDS}),
            data=grain.checkpoint.CheckpointRestore(data_iterator)))
        return TrainState(params=restored.model["params"], biases=restored.model["biases"], **restored.train)

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.close()


def model_target(abstract: ZayaLM, shardings: dict | None = None) -> dict:
    """The restore target of the `model` item for `abstract` (a model of ShapeDtypeStructs).

    {params, biases} ShapeDtypeStructs carrying `shardings` (a {params: tree, biases: sharding}
    matching them; default: none, which restore_model places on this process's first device).
    """
    params, biases = ModelParts.arrays(abstract)
    tree = {"params": params, "biases": biases}
    return tree if shardings is None else with_shardings(tree, shardings)


def restore_model(directory: str, target: dict, step: int | None = None) -> tuple[dict, int]:
    """The `model` item ({params, biases}) of `step` (default: the latest) onto `target`'s shardings.

    A target leaf without a sharding goes onto this process's first device (Orbax would otherwise
    use the sharding saved in the checkpoint, which fails whenever the saving process had other devices).
    """
    manager = _manager(directory, None, False)
    step = manager.latest_step() if step is None else step
    if step is None:
        raise FileNotFoundError(f"{directory}: no finished checkpoint (a step directory written by the trainer "
                                "or `python -m zaya_jax.convert to_orbax`)")
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    target = jax.tree.map(lambda a: a if getattr(a, "sharding", None) is not None
                          else jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device), target)
    restored = manager.restore(step, args=ocp.args.Composite(model=ocp.args.StandardRestore(target)))
    manager.close()
    return restored.model, step


def read_config(directory: str, step: int | None = None) -> ml_collections.ConfigDict:
    """The run config saved with a checkpoint."""
    manager = _manager(directory, None, False)
    step = manager.latest_step() if step is None else step
    if step is None:
        raise FileNotFoundError(f"{directory}: no finished checkpoint")
    config = manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore())).config
    manager.close()
    return ml_collections.ConfigDict(config)


def save_model(directory: str, params: dict, biases: Any, config: dict, step: int = 0) -> None:
    """Writes a model-only checkpoint (params, biases, config) at `step`, synchronously."""
    manager = _manager(directory, None, False)
    manager.save(step, args=ocp.args.Composite(model=ocp.args.StandardSave({"params": params, "biases": biases}),
                                               config=ocp.args.JsonSave(config)), force=True)
    manager.wait_until_finished()
    manager.close()


def checkpoint_dir(path: str) -> str:
    """A run's WORKDIR or its WORKDIR/checkpoints -> the directory holding the step directories."""
    nested = os.path.join(path, "checkpoints")
    return nested if os.path.isdir(nested) else path


def load_checkpoint_model(path: str, step: int | None = None, **overrides) -> tuple[ZayaLM, int]:
    """(ZayaLM, step) from the `model` item and saved config of a checkpoint, on this process's first device.

    `path`: a checkpoint directory or a run's WORKDIR; `overrides` set ModelConfig fields of the
    saved config (dtype, moe_backend, ...). Works whatever mesh and device count wrote the checkpoint.
    """
    directory = checkpoint_dir(path)
    abstract = abstract_model(model_config(read_config(directory, step)).replace(**overrides))
    model, step = restore_model(directory, model_target(abstract), step)
    return ModelParts(abstract).merge(model["params"], model["biases"]), step
