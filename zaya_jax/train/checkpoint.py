"""Orbax checkpoints of a training run: one directory per step under the workdir.

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
step that passes, saying which steps they passed over and why: the trainer (`resume_point`) also
moves the damaged newer steps to `<directory>.rejected/` (never deletes them) so that new saves
cannot collide with them; the read-only loaders (`restore_model`, `read_config`,
`load_checkpoint_model`) only read, create nothing, and raise `UserError` naming the directory when
no step passes. A failed asynchronous write is raised by `poll()` at the next step boundary as one
`CheckpointWriteError` line.

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
import re
import shutil
import sys
import tempfile
from typing import Any, Callable

import grain
import jax
import ml_collections
import orbax.checkpoint as ocp
from absl import logging
from flax import nnx

from zaya_jax.config_files import model_config, vision_config
from zaya_jax.errors import UserError
from zaya_jax.model.vision.vl import ZayaVL, build_model
from zaya_jax.model.zaya import ZayaLM
from zaya_jax.parallel import distributed
from zaya_jax.train import integrity
from zaya_jax.train.sealing import Sealer
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


def _manager(directory: str, max_to_keep: int | None, async_save: bool, sealer: Sealer) -> ocp.CheckpointManager:
    """A manager that writes `directory`, each step sealed with its manifest before Orbax commits it."""
    options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, enable_async_checkpointing=async_save,
                                           cleanup_tmp_directories=True, create=True,
                                           temporary_path_class=sealer.path_class)
    return ocp.CheckpointManager(os.path.abspath(directory), options=options)


def _reader(directory: str) -> ocp.CheckpointManager:
    """A manager that only reads `directory` (creates nothing, deletes nothing)."""
    options = ocp.CheckpointManagerOptions(create=False, cleanup_tmp_directories=False)
    return ocp.CheckpointManager(os.path.abspath(directory), options=options)


class CheckpointWriteError(RuntimeError):
    """An asynchronous checkpoint write failed (disk full, directory not writable, ...): one line."""


_OS_ERROR = re.compile(r"os_error_code='?(\d+)")  # how TensorStore reports an OS error inside a ValueError
_FAILED_FILE = re.compile(r'(?:Failed writing: |at local file )"([^"]+)"')


def _os_error(e: OSError) -> str:
    return f"{e.strerror} (errno {e.errno})"


def root_cause(error: BaseException) -> str:
    """The operating system's error (text, errno, file) behind a failed write, else the error's first line."""
    seen, e = [], error
    while e is not None and e not in seen:
        seen.append(e)
        if isinstance(e, OSError) and e.strerror:
            return _os_error(e) + (f": {e.filename}" if e.filename else "")
        found, files = _OS_ERROR.search(str(e)), _FAILED_FILE.findall(str(e))
        if found:
            errno = int(found[1])
            return f"{os.strerror(errno)} (errno {errno}){f': {files[-1]}' if files else ''}"
        e = e.__cause__ or e.__context__
    lines = str(error).strip().splitlines() or [type(error).__name__]
    return f"{type(error).__name__}: {lines[0][:300]}"


def unwritable(directory: str) -> str | None:
    """Why no step directory can be made in `directory` now (the operating system's error), or None.

    Orbax must not be the one to find out: when it cannot create a step's temporary directory, its
    other save threads wait for a signal that never comes (the save hangs instead of failing), so
    every save checks first.
    """
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".zaya-write-check-", dir=directory))
    except OSError as e:
        return _os_error(e)
    return None


class _OrbaxErrorsOnOneLine(logging.logging.Filter):
    """Orbax logs a failed background write from each of its threads with a traceback (about 1,300
    lines); the loop raises the cause as one line, so Orbax's records keep their first line only."""

    def filter(self, record):
        if record.levelno >= logging.logging.ERROR and f"{os.sep}orbax{os.sep}" in record.pathname:
            record.msg, record.args = record.getMessage().splitlines()[0][:300], None
            record.exc_info = record.exc_text = None
        return True


logging.get_absl_logger().addFilter(_OrbaxErrorsOnOneLine())


def _is_late_write_callback(unraisable) -> bool:
    """RuntimeError('Event loop is closed') raised by asyncio's call_soon_threadsafe with no Python
    caller: TensorStore completing a write whose save (and so its event loop) had already failed.
    TensorStore reports each through sys.unraisablehook (a traceback apiece, tens of them around
    the failure); the failure itself is raised as one line (CheckpointWriteError)."""
    frames, tb = [], unraisable.exc_traceback
    while tb is not None:
        frames.append(tb.tb_frame.f_code.co_name)
        tb = tb.tb_next
    return (unraisable.exc_type is RuntimeError and str(unraisable.exc_value) == "Event loop is closed"
            and frames == ["call_soon_threadsafe", "_check_closed"])


def _without_late_write_callbacks(hook):
    def unraisablehook(unraisable):
        if not _is_late_write_callback(unraisable):
            hook(unraisable)
    return unraisablehook


sys.unraisablehook = _without_late_write_callbacks(sys.unraisablehook)


class Checkpointer:
    """Saves and restores TrainStates (plus data-iterator state and config) in `directory`."""

    def __init__(self, directory: str, settings: CheckpointSettings, reference: bool = False):
        """reference: the states saved and restored carry a reference model (a DPO run)."""
        self.directory = os.path.abspath(directory)
        self.items = integrity.ITEMS["training"] + (("reference",) if reference else ())
        try:
            os.makedirs(self.directory, exist_ok=True)
            problem = unwritable(self.directory)
        except OSError as e:
            problem = _os_error(e)
        if problem:
            raise UserError(f"checkpoint directory {self.directory} is not writable: {problem}; "
                            "fix its permissions (or free the file system) or choose another --workdir")
        self._sealer = Sealer(self.directory, "training")
        self._manager = _manager(self.directory, settings.max_to_keep, settings.async_save, self._sealer)
        self._pending: int | None = None  # the step saved last, until its write is known to have finished
        self._in_save = False  # inside the manager's save() call (a synchronous save runs all of it there)

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def resume_point(self, log: Callable[[str], None]) -> tuple[int, str] | None:
        """(step, kind) of the newest whole checkpoint (kind: 'training' or 'model'), or None if none exists.

        Damaged steps newer than it are logged and moved to `<directory>.rejected/` by process 0;
        every process restores the step process 0 chose. Raises UserError when step directories
        exist but none is whole (a run never restarts from scratch over its own checkpoints).
        """
        step, refusal = None, None
        if jax.process_index() == 0:
            step, skipped = integrity.newest_whole_step(self.directory, self.items)
            if step is None and skipped:
                refusal = (f"no whole checkpoint in {self.directory}: "
                           + "; ".join(f"step {s}: {why}" for s, why in skipped)
                           + f"\n(checked for each step: its {integrity.MANIFEST}, then the size and crc32 of every "
                           f"file of items {', '.join(self.items)}); nothing was moved or deleted. Restore "
                           f"step{'s' if len(skipped) > 1 else ''} {', '.join(str(s) for s, _ in skipped)} from a "
                           f"backup, or move {'them' if len(skipped) > 1 else 'it'} out of {self.directory} "
                           "(e.g. to checkpoints.rejected/) to start this run afresh")
            for s, why in skipped if refusal is None else []:
                log(f"checkpoint {s} skipped ({why}); moved to {self._set_aside(s)}")
        step = distributed.broadcast_int(-2 if refusal else -1 if step is None else step)  # every process refuses
        if step == -2:
            raise UserError(refusal or f"no whole checkpoint in {self.directory} (see process 0's message)")
        self._manager.reload()
        if step < 0:
            return None
        return step, integrity.kind_of(os.path.join(self.directory, str(step)))

    def _set_aside(self, step: int) -> str:
        rejected = self.directory + ".rejected"
        os.makedirs(rejected, exist_ok=True)
        target, n = os.path.join(rejected, str(step)), 0
        while os.path.exists(target):
            n += 1
            target = os.path.join(rejected, f"{step}.{n}")
        shutil.move(os.path.join(self.directory, str(step)), target)
        return target

    def newest_whole_training_step(self) -> int | None:
        """The newest step whose every item is intact (after `wait()`: the rollback target), as
        process 0 sees it (it writes the manifests), on every process."""
        step = None
        if jax.process_index() == 0:
            step, _ = integrity.newest_whole_step(self.directory, self.items)
            if step is not None and integrity.kind_of(os.path.join(self.directory, str(step))) != "training":
                step = None
        step = distributed.broadcast_int(-1 if step is None else step)
        return None if step < 0 else step

    def save(self, state: TrainState, data_iterator: grain.DatasetIterator, config: dict,
             files: dict[str, bytes] | None = None) -> int:
        """Starts saving `state` at its step; returns the step. Blocks only for the device-to-host copy
        (and for the previous save, if it is still being written). `files` ({path relative to the
        step directory: contents}, e.g. the run's tokenizer) are committed with the step (sealing.py)."""
        step = int(jax.device_get(state.step))
        self._finish_save()  # (Orbax would wait for it too); its manifest may still be being written
        problem = unwritable(self.directory)
        if problem:
            raise CheckpointWriteError(f"checkpoint {step} could not be written to {self.directory}: {problem}")
        args = ocp.args.Composite(
            model=ocp.args.StandardSave({"params": state.params, "biases": state.biases}),
            train=ocp.args.StandardSave({f: getattr(state, f) for f in TRAIN_FIELDS}),
            data=grain.checkpoint.CheckpointSave(data_iterator),
            config=ocp.args.JsonSave(config),
            **({} if state.reference is None else {"reference": ocp.args.StandardSave(state.reference)}))
        self._sealer.starting(step, lambda: self._in_save or self._manager.is_saving_in_progress(), files)
        self._in_save = True
        try:
            self._manager.save(step, args=args, force=True)
        except Exception as e:  # pylint: disable=broad-except
            raise CheckpointWriteError(f"checkpoint {step} could not be written to {self.directory}: "
                                       f"{root_cause(e)}") from None
        finally:
            self._in_save = False
        self._pending = step
        return step

    def restore(self, step: int, target: TrainState, data_iterator: grain.DatasetIterator) -> TrainState:
        """`target`: a TrainState of ShapeDtypeStructs with the shardings to restore onto (with a
        reference model when the run has one: UserError when the step holds none)."""
        reference = {}
        if target.reference is not None:
            if "reference" not in integrity.items_of(os.path.join(self.directory, str(step))):
                raise UserError(f"checkpoint {step} in {self.directory} has no reference model: it was not saved "
                                "by a train.objective=dpo run. Start DPO in a new workdir with "
                                f"--config.train.init_from_checkpoint={self.directory}")
            reference = {"reference": ocp.args.StandardRestore(target.reference)}
        restored = self._manager.restore(step, args=ocp.args.Composite(
            model=ocp.args.StandardRestore({"params": target.params, "biases": target.biases}),
            train=ocp.args.StandardRestore({f: getattr(target, f) for f in TRAIN_FIELDS}),
            data=grain.checkpoint.CheckpointRestore(data_iterator), **reference))
        return TrainState(params=restored.model["params"], biases=restored.model["biases"], **restored.train,
                          reference=restored.reference if reference else None)

    def poll(self) -> CheckpointWriteError | None:
        """At a step boundary: the error of the last save once it has finished, if it failed (the loop
        raises it once every process knows, so that none waits in a collective)."""
        try:
            if self._pending is not None and not self._manager.is_saving_in_progress():
                self._finish_save()
            self._raise_share_errors(wait=False)
        except CheckpointWriteError as e:
            return e
        return None

    def wait(self) -> None:
        """Blocks until the last save is on disk with its manifest (raises CheckpointWriteError if it failed)."""
        self._finish_save()
        self._raise_share_errors(wait=True)

    def _finish_save(self) -> None:
        """Waits for Orbax's write and commit (raising its error as one line)."""
        if self._pending is None:
            return
        step, self._pending = self._pending, None
        try:
            self._manager.wait_until_finished()  # raises the error of the background write
            self._manager.check_for_errors()
        except Exception as e:  # pylint: disable=broad-except
            raise CheckpointWriteError(f"checkpoint {step} could not be written to {self.directory}: "
                                       f"{root_cause(e)}") from None

    def _raise_share_errors(self, wait: bool) -> None:
        for error in self._sealer.errors(wait):
            raise CheckpointWriteError(f"the manifest of a checkpoint in {self.directory} could not be written: "
                                       f"{root_cause(error)}")

    def close(self) -> None:
        """Finishes the last save, then releases Orbax's threads."""
        try:
            self.wait()
        finally:
            self._sealer.close()
            self._manager.close()


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
    manager = _reader(directory)
    restored = manager.restore(step, args=ocp.args.Composite(**{item: ocp.args.StandardRestore(target)}))
    manager.close()
    return restored[item], step


def read_config(directory: str, step: int | None = None) -> ml_collections.ConfigDict:
    """The run config saved with a checkpoint (default: the newest whole one)."""
    step = whole_step(directory, ("config",), step)
    manager = _reader(directory)
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
    probe, manager = _StateProbe(), _reader(directory)
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
    manager = _manager(directory, None, False, sealer)
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
