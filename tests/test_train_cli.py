"""`python -m zaya_jax.train` end to end: outputs, exact resume after a kill, a crash mid-save,
SIGTERM, and bad configs named before anything compiles."""

import glob
import importlib.util
import os
import struct
import subprocess
import sys

import pytest

from tests.train_helpers import REPO, cli_env, run_train, train_losses
from zaya_jax.config_files import load_config_file
from zaya_jax.data import demo_data_config
from zaya_jax.errors import EXIT_PREEMPTED
from zaya_jax.train.loop import Trainer

SHORT = ("--config.optimizer.warmup_steps=1",)
RUN = (*SHORT, "--config.train.steps=8", "--config.train.log_every_steps=1", "--config.checkpoint.every_steps=3",
       "--config.eval.every_steps=4", "--config.monitor.heatmap_every_steps=2")


def _tensorboard_tags(directory) -> set[str]:
    from tensorboardX.proto import event_pb2
    tags = set()
    for path in glob.glob(os.path.join(directory, "events.out.tfevents.*")):
        data = open(path, "rb").read()
        offset = 0
        while offset < len(data):
            (length,) = struct.unpack("<Q", data[offset:offset + 8])
            event = event_pb2.Event.FromString(data[offset + 12:offset + 12 + length])
            tags.update(v.tag for v in event.summary.value)
            offset += 12 + length + 4
    return tags


def _check_outputs(workdir):
    """metrics.jsonl (train and eval records), TensorBoard events, the heatmap, checkpoints."""
    from zaya_jax.train.monitor import read_metrics
    record = read_metrics(str(workdir / "metrics.jsonl"))[-1]
    for key in ("step", "loss", "tokens_per_sec", "mfu", "lr", "grad_norm", "router_entropy", "expert_load_min",
                "expert_load_max", "drop_rate", "skip_rate", "skipped_steps"):
        assert key in record, key
    assert 0 <= record["router_entropy"] <= 1 and len(record["expert_load"]) == 2
    evals = read_metrics(str(workdir / "metrics.jsonl"), kind="eval")
    assert [r["step"] for r in evals] == [4, 8] and evals[0]["eval/synthetic/perplexity"] > 1
    assert {"train/loss", "train/router_entropy", "eval/synthetic/loss"} <= _tensorboard_tags(workdir / "tensorboard")
    assert (workdir / "expert_load.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(os.listdir(workdir / "checkpoints")) == ["3", "6", "8"]


def test_cli_outputs_and_exact_resume_after_sigkill_crash_mid_save_and_sigterm(tmp_path):
    reference = run_train(tmp_path / "ref", *RUN)
    assert reference.returncode == 0, reference.stderr[-3000:]
    _check_outputs(tmp_path / "ref")
    expected = train_losses(tmp_path / "ref")
    assert sorted(expected) == list(range(1, 9))
    run = tmp_path / "run"

    # 1. killed while checkpoint 6 is being written (checkpoint 3 is whole)
    crashed = run_train(run, *RUN, faults={"KILL_IN_SAVE": 6})
    assert crashed.returncode == -9
    entries = os.listdir(run / "checkpoints")
    assert "3" in entries and "6" not in entries and any(e.startswith("6.orbax-checkpoint-tmp") for e in entries)

    # 2. restarts from 3 (the half-written 6 is never restored), then SIGTERM after step 5: saves 5, exits 75 (requeue)
    stopped = run_train(run, *RUN, faults={"KILL_AT_STEP": 5, "KILL_SIGNAL": "SIGTERM"})
    assert stopped.returncode == EXIT_PREEMPTED, stopped.stderr[-3000:]
    assert "start at step 3: restored checkpoint 3" in stopped.stderr + stopped.stdout
    assert sorted(os.listdir(run / "checkpoints")) == ["3", "5"]

    # 3. a plain SIGKILL after step 7 (checkpoints 3 and 6 on disk), then a restart that finishes
    killed = run_train(run, *RUN, faults={"KILL_AT_STEP": 7, "KILL_SIGNAL": "SIGKILL"})
    assert killed.returncode == -9 and "start at step 5" in killed.stderr + killed.stdout
    finished = run_train(run, *RUN)
    assert finished.returncode == 0 and "start at step 6: restored checkpoint 6" in finished.stderr + finished.stdout
    assert train_losses(run) == expected  # bit-identical losses at every step


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="proves something only where torch is installed")
def test_the_tensorboard_writer_starts_without_importing_torch(tmp_path):
    """tensorboardX.writer imports torch if it can (the largest import of a run's start-up); the monitor's writer
    does not, and torch still imports after it (a fresh process: the suite's workers may hold torch)."""
    script = ("import sys; from zaya_jax.train.monitor import Monitor; "
              f"Monitor({str(tmp_path)!r}, 1, progress_bar=False, tensorboard=True).write({{'kind': 'train', 'step': 1, 'loss': 2.0}}); "
              "assert 'torch' not in sys.modules, 'torch imported'; import torch; print(torch.ones(1).item())")
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "1.0", done.stderr[-3000:]
    assert _tensorboard_tags(tmp_path / "tensorboard") == {"train/loss"}


@pytest.mark.parametrize("field,value,message", [
    ("optimizer.name", "sgd", "optimizer.name='sgd' does not exist"),
    ("train.microbatches", 3, "train.microbatches=3 must divide the global batch 8"),
    ("balancing.b1", 1.5, r"balancing.b1 must lie in \[0, 1\)"),
    ("mesh.data", 3, r"mesh: product of mesh axes \(data=3\) = 3 != 8 devices"),
    ("train.init_from_hf", "/nonexistent/hf", "train.init_from_hf: '/nonexistent/hf' is not a directory"),
    ("train.data", "pipeline", "train.data='pipeline' needs a data section"),
    ("checkpoint.evry_steps", 5, "checkpoint.evry_steps: unknown field"),
])
def test_bad_config_is_named_before_compiling(tmp_path, monkeypatch, field, value, message):
    monkeypatch.setattr(Trainer, "_initial_state", lambda self: pytest.fail("reached model initialisation"))
    config = load_config_file("configs/tiny.py")
    section, name = field.split(".")
    with config.unlocked():
        config[section][name] = value
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        Trainer(config, str(tmp_path))


def test_missing_data_files_are_named_before_compiling(tmp_path, monkeypatch):
    monkeypatch.setattr(Trainer, "_initial_state", lambda self: pytest.fail("reached model initialisation"))
    config = load_config_file("configs/tiny.py")
    config.data = demo_data_config()
    config.data.sources = {name: f"/nonexistent/{name}" for name in ("prose", "code", "math")}
    config.train.data = "pipeline"
    with pytest.raises(FileNotFoundError, match=r"data.sources.\w+: data directory '/nonexistent/\w+' does not exist"):
        Trainer(config, str(tmp_path))


def test_cli_reports_a_bad_field(tmp_path):
    result = run_train(tmp_path, "--config.optimizer.schedule=linear")
    assert result.returncode != 0
    assert "optimizer.schedule='linear' does not exist" in result.stderr
    assert not os.path.exists(tmp_path / "checkpoints" / "0")


@pytest.mark.parametrize("path", ["configs/tiny.py", "configs/demo.py", "configs/bench_small.py",
                                  "configs/zaya1_base.py", "configs/zaya1_8b.py"])
def test_shipped_configs_have_valid_training_sections(path):
    from zaya_jax.train.data import phases_of
    from zaya_jax.train.settings import settings_from_config
    config = load_config_file(path)
    settings = settings_from_config(config)
    phases = phases_of(config, settings)
    assert settings.train.steps <= sum(p.num_batches for p in phases) or settings.train.data == "synthetic"
    if path.endswith("tiny.py"):
        assert settings.train.global_batch_size % 8 == 0


def test_a_restart_names_another_architecture_a_run_already_done_and_a_stop(tmp_path):
    """Through the CLI: a resume with another architecture ends in `error:` lines naming the field and
    the fix (no Orbax traceback; the checkpoints intact); train.steps at or below the restored step
    says there is nothing to train; a run stopped by a signal says so, with the step of the loss it
    shows."""
    run = tmp_path / "run"
    base = ("--config.optimizer.warmup_steps=1", "--config.optimizer.name=adamw", "--config.train.log_every_steps=2",
            "--config.eval.every_steps=0", "--config.monitor.tensorboard=False", "--config.monitor.heatmap_every_steps=0",
            "--config.checkpoint.every_steps=0")
    first = run_train(run, *base, "--config.train.steps=3")
    assert first.returncode == 0, first.stderr[-3000:]
    assert f"finished at step 3, loss {train_losses(run)[3]:.4f}" in first.stdout
    assert not (run / ".lock").exists()  # a clean finish leaves the workdir without its lock file
    width = load_config_file("configs/tiny.py").model.hidden_size
    other = run_train(run, *base, "--config.train.steps=5", f"--config.model.hidden_size={2 * width}")
    assert other.returncode == 2 and "Traceback" not in other.stderr, other.stderr[-3000:]
    assert (f"error: resuming {run / 'checkpoints'} step 3: the checkpoint has model.hidden_size={width} but the "
            f"config says {2 * width}") in other.stderr
    assert "resume with the config that run was trained with (its checkpoints are intact)" in other.stderr
    assert sorted(os.listdir(run / "checkpoints")) == ["3"]
    fewer = run_train(run, *base, "--config.train.steps=2")
    assert fewer.returncode == 0, fewer.stderr[-3000:]
    assert "already at step 3, train.steps=2: nothing to train (raise --config.train.steps to train on)" in fewer.stdout
    stopped = run_train(run, *base, "--config.train.steps=9", faults={"KILL_AT_STEP": 5, "KILL_SIGNAL": "SIGTERM"})
    assert stopped.returncode == EXIT_PREEMPTED, stopped.stderr[-3000:]
    assert max(train_losses(run)) == 4  # logged every 2 steps: step 5's loss was never logged
    assert f"stopped by signal 15 at step 5, last logged loss {train_losses(run)[4]:.4f} (step 4)" in stopped.stdout
    assert "finished at step" not in stopped.stdout
