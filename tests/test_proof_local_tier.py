"""The local checkpoint tier (checkpoint.local_dir, local_tier.py) on this CPU.

A 2-process job (1 CPU device each, the state sharded fsdp=2 across them) saves its local tier
every 2 steps and its persistent tier every 4; process 0 is SIGKILLed after step 7 and process 1
with it, and process 0's whole local directory is deleted (a replaced node). The restart resumes
from local step 6, not persistent step 4: process 0's shards come back from process 1's peer
copy, and every loss any attempt logged equals an uninterrupted run's without a local tier (one
process, 8 devices; to the last bits of float32: gloo sums in another order, as
test_proof_kill_after_commit says). A damaged local copy is named and skipped, never restored; bad
input ends in one `error:` line before training.
"""

import json
import os
import shutil
import signal
import time

import jax
import orbax.checkpoint as ocp
import pytest

from tests.test_cli_errors import assert_user_error
from tests.test_proof_kill_after_commit import logged_losses
from tests.train_helpers import RERUN_IF_OVERLOADED, Job, flip_bytes_of_item, run_train, uninterrupted_losses
from zaya_jax.checkpoints import integrity

STEPS, EVERY, LOCAL, KILL = 10, 4, 2, 7
RUN = ("--config.optimizer.warmup_steps=1", "--config.optimizer.name=adamw", "--config.train.log_every_steps=1",
       "--config.eval.every_steps=0", "--config.monitor.tensorboard=False", "--config.monitor.heatmap_every_steps=0",
       "--config.mesh.fsdp=2", f"--config.train.steps={STEPS}", f"--config.checkpoint.every_steps={EVERY}")


def tier(local_dir) -> tuple[str, ...]:
    return (f"--config.checkpoint.local_dir={local_dir}", f"--config.checkpoint.local_every={LOCAL}")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted run without a local tier: {step: loss}."""
    losses = uninterrupted_losses(tmp_path_factory.mktemp("uninterrupted"), *RUN)
    assert sorted(losses) == list(range(1, STEPS + 1))
    return losses


def killed_job(workdir, local, *run) -> str:
    """A 2-process job with a local tier, process 0 SIGKILLed after step KILL and process 1 with it
    -> process 0's output."""
    job = Job(workdir, *run, *tier(local), faults={"KILL_AT_STEP": KILL, "KILL_SIGNAL": "SIGKILL"})
    deadline = time.time() + 300
    while job.processes[0].poll() is None:
        job.check_running(deadline, f"process 0 was not killed after step {KILL}") if time.time() > deadline else None
        time.sleep(0.05)
    job.signal(1, signal.SIGKILL)
    codes, _ = job.finish()
    assert codes[0] == -signal.SIGKILL, (codes, job.output(0)[-3000:], job.output(1)[-3000:])
    return job.output(0)


def resumed_job(workdir, local, reference, *run) -> str:
    """The restarted job, run to the end: process 0's output, once every logged loss equals `reference`'s."""
    resumed = Job(workdir, *run, *tier(local))
    codes, _ = resumed.finish(timeout=300)
    assert codes == [0, 0], resumed.output(0)[-3000:] + resumed.output(1)[-3000:]
    logged = logged_losses(workdir)
    assert sorted({s for s, _ in logged}) == list(range(1, STEPS + 1))
    assert [loss for _, loss in logged] == pytest.approx([reference[s] for s, _ in logged], rel=1e-6, abs=0)
    return resumed.output(0)


@pytest.mark.xdist_group("multiprocess")
@pytest.mark.flaky(**RERUN_IF_OVERLOADED)
def test_a_lost_node_resumes_from_the_newest_local_step_through_its_peer(reference, tmp_path):
    """Then the restarted job is killed again after step 7, before its next local save, and the
    other node is replaced: the restore wrote step 6 again on both processes, so the third start
    also resumes from local step 6, now through process 0's peer copy."""
    workdir, local = tmp_path / "run", tmp_path / "local"
    killed_job(workdir, local, *RUN)
    assert integrity.steps_in(str(workdir / "checkpoints")) == [EVERY]  # the persistent tier is older
    shutil.rmtree(local / "process_0")  # the replaced node's local storage
    output = killed_job(workdir, local, *RUN)
    assert (f"start at step 6: restored local step 6 ({local}; process 0's shards from process 1's peer copy)"
            in output), output[-3000:]
    shutil.rmtree(local / "process_1")
    output = resumed_job(workdir, local, reference, *RUN)
    assert (f"start at step 6: restored local step 6 ({local}; process 1's shards from process 0's peer copy)"
            in output), output[-3000:]
    assert sorted(os.listdir(local / "process_1" / "own")) == ["10", "8"]  # the new node keeps the tier again
    # Its own copy is an Orbax item of every state array (Orbax's own metadata reader agrees with the
    # layout the tier recorded), written by process 1 alone: one per-process OCDBT database, its own.
    step = local / "process_1" / "own" / "10"
    arrays = jax.tree.leaves(ocp.PyTreeCheckpointer().metadata(step / "state").item_metadata.tree)
    with open(step / "data" / "about.json") as f:
        assert [tuple(a.shape) for a in arrays] == [tuple(shape) for shape, _, _ in json.load(f)["layout"]]
    assert [p.name for p in (step / "state").glob("ocdbt.process_*")] == ["ocdbt.process_1"]


@pytest.mark.xdist_group("multiprocess")
@pytest.mark.flaky(**RERUN_IF_OVERLOADED)
def test_local_tiers_that_disagree_resume_from_the_newest_step_every_process_holds(reference, tmp_path):
    """No persistent step before the kill (every 8 steps); process 1 lost its step 6 and process 0
    its peer copy of it (a kill in the middle of a local save leaves such tiers), so step 6 cannot be
    restored everywhere: every process takes local step 4, process 0 although it holds its own 6."""
    workdir, local = tmp_path / "run", tmp_path / "local"
    run = (*RUN[:-1], "--config.checkpoint.every_steps=8")
    killed_job(workdir, local, *run)
    assert integrity.steps_in(str(workdir / "checkpoints")) == []
    shutil.rmtree(local / "process_1" / "own" / "6")
    shutil.rmtree(local / "process_0" / "peer" / "6")
    output = resumed_job(workdir, local, reference, *run)
    assert f"start at step 4: restored local step 4 ({local})" in output, output[-3000:]


def test_a_damaged_local_copy_is_named_and_skipped(reference, tmp_path):
    workdir, local = tmp_path / "run", tmp_path / "local"
    killed = run_train(workdir, *RUN, *tier(local), faults={"KILL_AT_STEP": KILL, "KILL_SIGNAL": "SIGKILL"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    damaged = local / "process_0" / "own" / "6"
    flip_bytes_of_item(damaged, "state")
    # Step 4 whole, but saved (as it says, its manifest rewritten to match) with the mesh's devices in
    # another order: this process held other shards then, which Orbax would read as missing (zeros).
    moved = local / "process_0" / "own" / "4"
    about = json.loads((moved / "data" / "about.json").read_text())
    (moved / "data" / "about.json").write_text(json.dumps({**about, "devices": about["devices"][::-1]}))
    integrity.write_manifest(str(moved), "local")
    finished = run_train(workdir, *RUN, *tier(local))
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert f"process 0: local step 6 in {damaged} skipped (state/" in finished.stdout
    assert "fails its checksum" in finished.stdout
    assert f"process 0: local step 4 in {moved} skipped (saved with the mesh's devices placed as" in finished.stdout
    assert f"start at step {EVERY}: restored checkpoint {EVERY}" in finished.stdout  # local 4 is no newer
    assert [(s, loss) for s, loss in logged_losses(workdir) if loss != reference[s]] == []


def test_bad_local_tier_input_is_one_error_line_before_training(tmp_path):
    assert_user_error(run_train(tmp_path / "a", *RUN, f"--config.checkpoint.local_dir={tmp_path}/l",
                                "--config.checkpoint.local_every=3"),
                      "checkpoint.local_every=3 must divide checkpoint.every_steps=4")
    assert_user_error(run_train(tmp_path / "b", *RUN, f"--config.checkpoint.local_dir={tmp_path}/l"),
                      "checkpoint.local_dir and checkpoint.local_every go together")
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    assert_user_error(run_train(tmp_path / "c", *RUN, *tier(blocked)), f"checkpoint.local_dir: {blocked}",
                      "is not writable")
    other = tmp_path / "other"
    os.makedirs(other / "process_0" / "own" / "2")
    (other / "process_0" / "run.json").write_text('{"run": "an-earlier-run"}')
    done = run_train(tmp_path / "d", *RUN, *tier(other))
    assert_user_error(done, "holds the local tier of another run (run id an-earlier-run", "empty that directory")
    assert os.path.isdir(other / "process_0" / "own" / "2")  # nothing saved is lost
    assert "step 1" not in done.stdout


def test_a_local_step_from_another_config_is_refused_before_training(tmp_path):
    """Only local steps exist (the kill comes before the first persistent save), so the persistent
    tier's resume checks see nothing; the local step's own saved config is checked the same way."""
    workdir, local = tmp_path / "run", tmp_path / "local"
    run = (*RUN[:-1], "--config.checkpoint.every_steps=8")
    killed = run_train(workdir, *run, *tier(local), faults={"KILL_AT_STEP": 3, "KILL_SIGNAL": "SIGKILL"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert integrity.steps_in(str(workdir / "checkpoints")) == []
    done = run_train(workdir, *run, *tier(local), "--config.optimizer.name=muon")
    assert_user_error(done, f"resuming {local}/process_0/own step 2: its optimizer state was saved with "
                            "optimizer.name='adamw'")
    assert "step 3" not in done.stdout and os.listdir(local / "process_0" / "own") == ["2"]  # nothing lost
