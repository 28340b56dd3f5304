"""Faults through the real CLI: damaged checkpoints, stops agreed by 2 processes, the rollback
budget, a failed checkpoint write, a second trainer on one workdir."""

import os
import re
import shutil
import socket
import subprocess
import sys
import time
import zlib

import jax
import numpy as np
import pytest
from flax import nnx

from tests.train_helpers import (DAMAGE, REPO, RERUN_IF_OVERLOADED, Job, cli_env, empty_folder, flip_model_bytes,
                                 run_train, train_losses)
from zaya_jax.errors import EXIT_FAILED, EXIT_PREEMPTED, EXIT_USER_ERROR, UserError
from zaya_jax.checkpoints import integrity
from zaya_jax.checkpoints.orbax_checkpoint import load_checkpoint_model, read_config, restore_model
from zaya_jax.train.checkpoint import Checkpointer
from zaya_jax.train.settings import CheckpointSettings

SHORT = ("--config.optimizer.warmup_steps=1", "--config.optimizer.name=adamw", "--config.train.log_every_steps=1",
         "--config.eval.every_steps=0", "--config.monitor.tensorboard=False", "--config.monitor.heatmap_every_steps=0")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """A 4-step CLI run with checkpoints 2 and 4, and its losses."""
    workdir = tmp_path_factory.mktemp("reference")
    result = run_train(workdir, *SHORT, "--config.train.steps=4", "--config.checkpoint.every_steps=2")
    assert result.returncode == 0, result.stderr[-3000:]
    assert integrity.steps_in(str(workdir / "checkpoints")) == [4, 2]
    return workdir, train_losses(workdir)


def _copy(reference_dir, target):
    shutil.copytree(reference_dir, target, ignore=shutil.ignore_patterns(".lock"))
    return target


@pytest.mark.parametrize("variant", sorted(DAMAGE))
def test_read_only_loaders_fall_back_past_a_damaged_step_or_refuse_it_by_name(reference, tmp_path, variant):
    damage, reason = DAMAGE[variant]
    pristine, _ = load_checkpoint_model(str(reference[0]), step=2)
    run = _copy(reference[0], tmp_path / "run")
    damage(str(run / "checkpoints" / "4"))
    model, step = load_checkpoint_model(str(run))
    assert step == 2
    for a, b in zip(jax.tree.leaves(nnx.state(model, nnx.Param)), jax.tree.leaves(nnx.state(pristine, nnx.Param))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(UserError, match=rf"no whole checkpoint at .*checkpoints \(step 4\): step 4: {reason}"):
        load_checkpoint_model(str(run), step=4)
    assert sorted(os.listdir(run / "checkpoints")) == ["2", "4"]  # a reader moves nothing


def test_read_only_loaders_create_nothing(tmp_path):
    missing = tmp_path / "nope"
    for load in (lambda: read_config(str(missing)), lambda: restore_model(str(missing), {}),
                 lambda: load_checkpoint_model(str(missing))):
        with pytest.raises(UserError, match=f"no checkpoint at {missing}"):
            load()
    assert not missing.exists()
    result = subprocess.run([sys.executable, "-m", "zaya_jax.evaluate", "--checkpoint", str(missing)], cwd=REPO,
                            env=cli_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode != 0 and f"no checkpoint at {missing}" in result.stderr
    assert not missing.exists()


def test_resume_skips_a_checkpoint_missing_its_train_item(reference, tmp_path):
    """Never a silent restart from step 0: the damaged step 4 is set aside, the run resumes from 2,
    and steps 3 and 4 repeat the reference's losses bit for bit."""
    reference_dir, expected = reference
    run = _copy(reference_dir, tmp_path / "run")
    shutil.rmtree(run / "checkpoints" / "4" / "train")
    os.remove(run / "metrics.jsonl")
    result = run_train(run, *SHORT, "--config.train.steps=4", "--config.checkpoint.every_steps=2")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "checkpoint 4 skipped (item 'train' is missing); moved to" in result.stdout
    assert "start at step 2: restored checkpoint 2" in result.stdout
    assert train_losses(run) == {3: expected[3], 4: expected[4]}
    assert os.listdir(run / "checkpoints.rejected") == ["4"]
    assert integrity.steps_in(str(run / "checkpoints")) == [4, 2]


def test_resume_refuses_a_workdir_whose_every_checkpoint_is_damaged(reference, tmp_path):
    run = _copy(reference[0], tmp_path / "run")
    flip_model_bytes(str(run / "checkpoints" / "4"))
    empty_folder(str(run / "checkpoints" / "2"))
    checkpointer = Checkpointer(str(run / "checkpoints"), CheckpointSettings())
    with pytest.raises(UserError, match=r"no whole checkpoint in .*: step 4: model/.* fails its checksum .*; "
                                        r"step 2: no zaya_manifest.json"):
        checkpointer.resume_point(print)
    checkpointer.close()
    assert sorted(os.listdir(run / "checkpoints")) == ["2", "4"]


def test_a_refused_resume_names_each_step_and_what_was_checked_on_lines_of_its_own(reference, tmp_path):
    """Through the CLI with the progress bar and TensorBoard on: the refusal is not printed on the bar's
    line, and it is all of stderr (the refusal comes once the monitor has started: what start-up opened is
    closed, so no writer thread is left to fail at exit, as tensorboardX's did on Python 3.12)."""
    run = _copy(reference[0], tmp_path / "run")
    flip_model_bytes(str(run / "checkpoints" / "4"))
    os.remove(run / "checkpoints" / "2" / integrity.MANIFEST)  # as an older zaya_jax left a step it was killed sealing
    result = run_train(run, *SHORT, "--config.train.steps=4", "--config.monitor.progress_bar=True",
                       "--config.monitor.tensorboard=True")
    assert result.returncode == EXIT_USER_ERROR, result.stderr[-3000:]
    lines = result.stderr.split("\n")
    first = next(i for i, line in enumerate(lines) if "no whole checkpoint" in line)
    assert lines[first].startswith(f"error: no whole checkpoint in {run / 'checkpoints'}: step 4: model/")
    assert "fails its checksum" in lines[first]
    assert "step 2: no zaya_manifest.json, though Orbax committed the step" in lines[first]
    assert ("(checked for each step: its zaya_manifest.json, then the size and crc32 of every file of items "
            "model, train, data, config); nothing was moved or deleted. Restore steps 4, 2 from a backup") \
        in lines[first + 1]
    assert "step/s" not in result.stderr and "\r" not in "".join(lines[:first + 2])  # no bar drawn before it
    assert result.stderr.strip().split("\n") == lines[first:first + 2]
    assert sorted(os.listdir(run / "checkpoints")) == ["2", "4"]


@pytest.mark.parametrize("override, refusal", [
    ("--config.train.objective=sft",
     "its checkpoints were written by a train.objective='lm' run on synthetic data, and this config is a "
     "train.objective='sft' run on synthetic data: resume it with the config it was trained with, or train this "
     "config in a new --workdir (a post-training config starts from its source run through "
     "train.init_from_checkpoint)"),
    ("--config.optimizer.name=muon",
     "its optimizer state was saved with optimizer.name='adamw', and this config says 'muon': resume it with the "
     "config it was trained with, or train this config in a new --workdir"),
])
def test_a_resume_with_another_objective_or_optimizer_is_one_line_and_writes_nothing(reference, tmp_path, override,
                                                                                     refusal):
    """Resuming a run with a config of another objective (here its synthetic rows would even fit) or
    optimizer (a traceback of Orbax's tree-structure mismatch) is refused before anything is
    opened: its `error:` line is all of stderr and the workdir is as it was."""
    run = _copy(reference[0], tmp_path / "run")
    before = sorted(run.rglob("*"))
    result = run_train(run, *SHORT, "--config.train.steps=6", override, "--config.monitor.tensorboard=True")
    assert result.returncode == EXIT_USER_ERROR, result.stderr[-3000:]
    assert result.stderr.strip() == f"error: resuming {run / 'checkpoints'} step 4: {refusal}"
    assert sorted(run.rglob("*")) == before and result.stdout == ""


def test_rollback_budget_ends_the_run_and_skipped_saves_are_logged(tmp_path):
    result = run_train(tmp_path, *SHORT, "--config.train.steps=8", "--config.checkpoint.every_steps=2",
                       "--config.train.max_nonfinite_streak=3", "--config.train.max_rollbacks=1",
                       faults={"POISON_FROM_STEP": 3}, timeout=240)
    assert result.returncode == EXIT_FAILED, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1] == (
        "TrainingFailed: 3 non-finite steps in a row at step 6 after 1 rollback(s) (train.max_rollbacks=1): "
        "the run diverges; lower the learning rate or inspect the data, then resume from the last checkpoint")
    assert result.stdout.count("step 4: checkpoint not saved, 1 non-finite step(s) in a row") == 2
    assert "3 non-finite steps in a row at step 6: rolled back to checkpoint 2" in result.stdout
    assert integrity.steps_in(str(tmp_path / "checkpoints")) == [2]


def test_a_rollback_goes_to_the_newest_local_step_when_the_local_tier_is_newer(tmp_path):
    """Local saves every 2 steps, persistent every 4: the parameters turn NaN after step 3, so the
    persistent save of step 4 is skipped and the rollback at step 5 takes local step 2 (before the
    local tier, there was no checkpoint to roll back to and the run failed)."""
    result = run_train(tmp_path / "run", *SHORT, "--config.train.steps=8", "--config.checkpoint.every_steps=4",
                       f"--config.checkpoint.local_dir={tmp_path}/local", "--config.checkpoint.local_every=2",
                       "--config.train.max_nonfinite_streak=2", "--config.train.max_rollbacks=1",
                       faults={"POISON_FROM_STEP": 3}, timeout=240)
    assert result.returncode == EXIT_FAILED, result.stderr[-3000:]
    assert "2 non-finite steps in a row at step 5: rolled back to local step 2" in result.stdout, result.stdout
    assert "after 1 rollback(s)" in result.stderr.strip().splitlines()[-1]


def test_a_failed_checkpoint_write_stops_the_run_at_the_next_step(tmp_path):
    result = run_train(tmp_path, *SHORT, "--config.train.steps=16", "--config.checkpoint.every_steps=8",
                       faults={"FSIZE_LIMIT_AT_STEP": 2})
    assert result.returncode == EXIT_FAILED, result.stderr[-3000:]
    assert "Event loop is closed" not in result.stderr  # TensorStore's writes completing after the failure
    expected = (f"CheckpointWriteError: checkpoint 8 could not be written to {tmp_path}/checkpoints: "
                f"File too large (errno 27): {tmp_path}/checkpoints/8.orbax-checkpoint-tmp/")
    assert expected in result.stderr, result.stderr[-3000:]
    orbax_records = [ln for ln in result.stderr.splitlines() if re.match(r"E\d{4} .*\] \[process=0\]", ln)]
    assert orbax_records and all(len(ln) < 400 for ln in orbax_records)  # Orbax's records: one short line each
    # raised at the first step boundary after the write failed (on main: at the next save, the final step 16)
    assert 8 <= max(train_losses(tmp_path)) < 16
    assert integrity.steps_in(str(tmp_path / "checkpoints")) == []


def test_an_unwritable_checkpoint_directory_is_named_and_earlier_checkpoints_stay(tmp_path):
    """File modes bind the trainer (as root: without CAP_DAC_OVERRIDE). Before: the save of step 4
    into a read-only directory hung (Orbax's other save threads waited for the failed one)."""
    checkpoints = tmp_path / "checkpoints"
    args = (*SHORT, "--config.train.steps=8", "--config.checkpoint.every_steps=2")
    try:
        # 1. the directory becomes read-only after checkpoint 2: the save of 4 fails, one line, exit 1
        result = run_train(tmp_path, *args, faults={"READ_ONLY_AT_STEP": 3}, unprivileged=True, timeout=240)
        assert os.stat(checkpoints).st_mode & 0o777 == 0o555  # the fault fired
        assert result.returncode == EXIT_FAILED, result.stderr[-3000:]
        assert result.stderr.strip().splitlines()[-1] == (
            f"CheckpointWriteError: checkpoint 4 could not be written to {checkpoints}: Permission denied (errno 13)")
        assert max(train_losses(tmp_path)) == 4 and sorted(os.listdir(checkpoints)) == ["2"]  # nothing partial
        assert integrity.problem(str(checkpoints / "2"), integrity.ITEMS["training"]) is None
        # 2. a restart on the read-only directory is refused before anything compiles, exit 2
        result = run_train(tmp_path, *args, unprivileged=True, timeout=240)
        assert result.returncode == EXIT_USER_ERROR, result.stderr[-3000:]
        assert result.stderr.strip().splitlines()[-1] == (
            f"error: checkpoint directory {checkpoints} is not writable: Permission denied (errno 13); "
            "fix its permissions (or free the file system) or choose another --workdir")
        assert "topology" not in result.stdout and sorted(os.listdir(checkpoints)) == ["2"]
    finally:
        os.chmod(checkpoints, 0o755)  # so that pytest can remove tmp_path


def test_only_late_tensorstore_callbacks_are_kept_quiet():
    """The filter on sys.unraisablehook (checkpoint.py) drops the closed-loop error of a callback
    with no Python caller (how TensorStore's late writes raise it) and passes every other one on,
    the same error raised from Python code included. (In a subprocess: pytest replaces the hook.)"""
    code = """
import asyncio, sys, types
from zaya_jax.train import checkpoint
loop = asyncio.new_event_loop()
loop.close()
def from_python():
    loop.call_soon_threadsafe(print)
try:
    from_python()
except RuntimeError as e:  # its traceback from call_soon_threadsafe on: as when TensorStore's thread calls it
    sys.unraisablehook(types.SimpleNamespace(exc_type=RuntimeError, exc_value=e, err_msg=None, object=None,
                                             exc_traceback=e.__traceback__.tb_next.tb_next))
print("LATE CALLBACK REPORTED", file=sys.stderr, flush=True)
class Finalizer:
    def __del__(self):
        raise RuntimeError("Event loop is closed")
Finalizer()
"""
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=cli_env(), capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    before, after = result.stderr.split("LATE CALLBACK REPORTED")
    assert "Event loop is closed" not in before
    assert "in __del__" in after and "RuntimeError: Event loop is closed" in after


# -- two processes ---------------------------------------------------------------------------


def _saved_step(job: Job) -> int:
    lines = [ln for ln in job.output(0).splitlines() if "saving step" in ln]
    assert len(lines) == 1, job.output(0)[-3000:]
    step = int(lines[0].split("saving step ")[1].split()[0])
    assert f"process 1: signal 15: saving step {step} and stopping" in job.output(1), job.output(1)[-3000:]
    return step


LONG = ("--config.train.steps=100000", "--config.checkpoint.every_steps=0")


def _finish_stopped(job: Job, previous: int) -> int:
    """Both processes exit 75 within 10 s once the step in flight is done (job.stop_limit_s()), having
    saved the same step (> `previous`, whole); returns it."""
    codes, seconds = job.finish()
    assert codes == [EXIT_PREEMPTED, EXIT_PREEMPTED] and seconds < job.stop_limit_s(), \
        job.output(0)[-3000:] + job.output(1)[-3000:]
    step = _saved_step(job)
    assert step > previous
    assert integrity.problem(str(job.workdir / "checkpoints" / str(step)), integrity.ITEMS["training"]) is None
    return step


def _resume_and_stop(workdir, previous: int, signals: list[tuple[int, float]]) -> int:
    """Resumes the 2-process job from checkpoint `previous`; once it trained a step, SIGTERMs
    [(process, seconds after the signal before)]; returns the step saved."""
    job = Job(workdir, *SHORT, *LONG)
    job.wait_for(f"start at step {previous}: restored checkpoint {previous}")
    job.wait_for_step(previous)
    for process, delay in signals:
        time.sleep(delay)
        job.signal(process)
    return _finish_stopped(job, previous)


# Multi-process jobs share one xdist worker (--dist loadgroup): two of them at once on 2 cores can
# leave a process past gloo's fixed 30 s wait for its peers at a first collective.
@pytest.mark.xdist_group("multiprocess")
@pytest.mark.flaky(**RERUN_IF_OVERLOADED)
def test_stops_are_agreed_by_two_processes_and_a_second_trainer_is_refused(tmp_path):
    workdir = tmp_path / "run"
    # 1. SIGTERM to process 1 only: both save the same step and exit 75; meanwhile a second trainer is refused
    job = Job(workdir, *SHORT, *LONG)
    job.wait_for_step(0)
    second = run_train(workdir, *SHORT)
    assert second.returncode == EXIT_USER_ERROR
    assert f"workdir {workdir} is in use by another trainer (host pid: {socket.gethostname()} " \
           f"{job.processes[0].pid}" in second.stderr
    job.signal(1)
    first = _finish_stopped(job, 0)
    assert integrity.steps_in(str(workdir / "checkpoints")) == [first]
    # 2. SIGTERM to both, 0.3 s apart (process 0 first); 3. two SIGTERMs 5 ms apart to process 1
    both = _resume_and_stop(workdir, first, [(0, 0.0), (1, 0.3)])
    twice = _resume_and_stop(workdir, both, [(1, 0.0), (1, 0.005)])
    # 4. SIGTERM to process 0 while the processes restore checkpoint `twice` (after the topology line,
    #    before any step): both stop without waiting for the restore, save nothing, exit 75
    job = Job(workdir, *SHORT, f"--config.train.steps={twice + 3}", "--config.checkpoint.every_steps=0")
    job.wait_for("topology:")
    job.signal(0)
    codes, seconds = job.finish()
    assert codes == [EXIT_PREEMPTED, EXIT_PREEMPTED] and seconds < job.stop_limit_s(), job.output(0)[-3000:]
    for i in range(2):
        assert "signal 15: stopping during start-up, before training; nothing new to save" in job.output(i)
    assert "start at step" not in job.output(0)  # the stop did not wait for the state
    assert max(train_losses(workdir)) == twice
    assert integrity.steps_in(str(workdir / "checkpoints")) == [twice, both, first]
    _check_manifest_of_two_processes(workdir / "checkpoints" / str(first), tmp_path)


def _check_manifest_of_two_processes(step_dir, tmp_path):
    """Each process checksummed a share of the step's files and process 0 combined them: the
    manifest lists every file with its crc32 (zlib's, computed here), and a damaged file written by
    either process is found (process 0: an OCDBT blob of ocdbt.process_0; process 1: its data
    iterator state, data/process_1-of-2.json: replicated arrays are written by process 0 alone)."""
    manifest = integrity.read_manifest(str(step_dir))
    assert len(manifest["shares"]) == 2 and min(manifest["shares"]) > 0
    on_disk = sorted(os.path.relpath(os.path.join(root, n), step_dir) for root, _, names in os.walk(step_dir)
                     for n in names if n != integrity.MANIFEST)
    # all but what Orbax writes at the top of the step when it commits it, after the manifest
    assert sorted(manifest["files"]) == [rel for rel in on_disk if rel not in integrity.COMMIT_RECORDS]
    assert set(on_disk) - set(manifest["files"]) == set(integrity.COMMIT_RECORDS)
    for rel, (size, crc) in manifest["files"].items():
        with open(step_dir / rel, "rb") as f:
            data = f.read()
        assert [len(data), zlib.crc32(data)] == [size, crc], rel
    for writer in (0, 1):
        copy = shutil.copytree(step_dir, tmp_path / f"damaged_by_{writer}")
        rel = max((r for r in manifest["files"] if f"process_{writer}" in r), key=lambda r: manifest["files"][r][0])
        with open(copy / rel, "r+b") as f:
            f.seek(manifest["files"][rel][0] // 2)
            chunk = f.read(16)
            f.seek(manifest["files"][rel][0] // 2)
            f.write(bytes(b ^ 0xFF for b in chunk))
        assert integrity.problem(str(copy), integrity.ITEMS["training"]).startswith(f"{rel} fails its checksum")


def test_damaged_data_shards_are_named_when_the_sources_open(tmp_path):
    """Before: a truncated shard opened fine and failed mid-run, naming no file."""
    from zaya_jax.data import prepare
    from zaya_jax.data.readers import InputError
    from zaya_jax.data.sources import open_sources
    tokenizer = {"sha256": "synthetic", "vocab_size": 65536, "bos_id": 2, "eos_id": 1, "pad_id": 0}
    docs = [np.arange(1 + 200 * i, 1 + 200 * i + 150) for i in range(400)]
    for name in ("truncated", "short"):
        prepare.write_tokenized(str(tmp_path / name), docs, tokenizer_info=tokenizer, num_shards=2)
    config = lambda name: type("DataConfig", (), {"sources": {"a": str(tmp_path / name)}, "heldout_fraction": 0.0})
    assert len(open_sources(config("truncated"))["a"].train) == 400  # whole shards open
    shard = tmp_path / "truncated" / "shard-00001-of-00002.array_record"
    os.truncate(shard, os.path.getsize(shard) // 2)
    with pytest.raises(InputError, match=rf"{shard}: not a readable ArrayRecord shard \(.*\); re-run .* data.sources.a"):
        open_sources(config("truncated"))
    prepare.write_tokenized(str(tmp_path / "other"), docs[:3], tokenizer_info=tokenizer, num_shards=1)
    shard = tmp_path / "short" / "shard-00000-of-00002.array_record"
    shutil.copy(tmp_path / "other" / "shard-00000-of-00001.array_record", shard)
    with pytest.raises(InputError, match=rf"{shard}: holds 3 records but the manifest lists 200"):
        open_sources(config("short"))
