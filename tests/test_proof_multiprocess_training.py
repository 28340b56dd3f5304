"""Two processes (launch/local.sh, 4 fake CPU devices each) train, checkpoint, are SIGKILLed and
resume; their losses equal one process with 8 devices on the same mesh.

Each process reads only its own rows of every global batch (zaya_jax.parallel.distributed),
the checkpoint is written jointly by both, and the restart restores it in both. The single
process is the reference; cross-process collectives (gloo) sum in another order, hence rel 1e-5.
"""

import os
import subprocess
import sys

import pytest

from tests.train_helpers import REPO, WRAPPER, cli_env, run_train, train_losses

ARGS = ["--config.mesh.data=2", "--config.mesh.fsdp=4", "--config.train.steps=4", "--config.train.log_every_steps=1",
        "--config.optimizer.warmup_steps=1", "--config.checkpoint.every_steps=2", "--config.eval.every_steps=0",
        "--config.monitor.tensorboard=False", "--config.monitor.heatmap_every_steps=0",
        "--config.monitor.progress_bar=False"]


def _two_processes(workdir, faults: dict | None = None) -> subprocess.CompletedProcess:
    env = {**cli_env(), "XLA_FLAGS": "", **{k: str(v) for k, v in (faults or {}).items()}}
    command = ["launch/local.sh", "2", "--devices-per-process", "4", sys.executable, "-c", WRAPPER,
               "--config", os.path.join(REPO, "configs/tiny.py"), "--workdir", str(workdir), *ARGS]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=400)


def test_two_processes_killed_and_resumed_match_one_process(tmp_path):
    single = run_train(tmp_path / "single", *ARGS)
    assert single.returncode == 0, single.stderr[-3000:]
    expected = train_losses(tmp_path / "single")
    assert sorted(expected) == [1, 2, 3, 4]

    run = tmp_path / "multi"
    killed = _two_processes(run, {"KILL_AT_STEP": 3, "KILL_SIGNAL": "SIGKILL"})
    assert killed.returncode != 0 and "'processes': 2" in killed.stdout, killed.stdout[-3000:]
    assert os.listdir(run / "checkpoints") == ["2"] and max(train_losses(run)) == 3  # killed after step 3

    resumed = _two_processes(run)
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert "[0] start at step 2: restored checkpoint 2" in resumed.stdout
    assert "[1] start at step 2: restored checkpoint 2" in resumed.stdout
    losses = train_losses(run)
    assert sorted(losses) == [1, 2, 3, 4]
    assert [losses[s] for s in range(1, 5)] == pytest.approx([expected[s] for s in range(1, 5)], rel=1e-5)
