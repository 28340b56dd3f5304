"""The trainer's Checkpointer: saves and restores whole TrainStates (model, train, data, config
and a DPO run's reference items) in the format of zaya_jax.checkpoints.orbax_checkpoint (whose
docstring describes the step directories, their manifests and how restores reshard), finds the step
to resume from (moving damaged newer steps to `<directory>.rejected/`), and reports a failed
asynchronous write at the next step boundary as one `CheckpointWriteError` line.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile
from typing import Callable

import grain
import jax
import orbax.checkpoint as ocp
from absl import logging

from zaya_jax.checkpoints import integrity
from zaya_jax.checkpoints.orbax_checkpoint import writer
from zaya_jax.checkpoints.sealing import Sealer
from zaya_jax.errors import UserError
from zaya_jax.parallel import distributed
from zaya_jax.train.settings import CheckpointSettings
from zaya_jax.train.state import TrainState

TRAIN_FIELDS = ("step", "opt_state", "controller_state", "rng", "skipped_steps", "nonfinite_streak")


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
        self._manager = writer(self.directory, settings.max_to_keep, settings.async_save, self._sealer)
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
