"""Running the training CLI in a subprocess, optionally with an injected fault.

Faults are injected from outside the product code: a wrapper script patches the loop's
per-step seam (Trainer._after_step) or Orbax's final rename, then runs the CLI's main.
  KILL_AT_STEP=n KILL_SIGNAL=SIGKILL|SIGTERM   signal this process after step n (once the
                                               checkpoints started so far are on disk)
  KILL_IN_SAVE=n                               SIGKILL while checkpoint n is being written (after
                                               its data, before Orbax renames it into place)
  POISON_FROM_STEP=n                           parameters set to NaN after every step >= n (the
                                               next step is non-finite, every time)
  FSIZE_LIMIT_AT_STEP=n                        after step n, files of this process may not grow
                                               past 100 kB (RLIMIT_FSIZE: writes fail with EFBIG,
                                               as on a full disk)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WRAPPER = r"""
import os, resource, signal
import jax, jax.numpy as jnp
from absl import app
from orbax.checkpoint._src.path import atomicity
from zaya_jax.train import loop
from zaya_jax.train.__main__ import main

kill_at, kill_in_save = int(os.environ.get("KILL_AT_STEP", -1)), os.environ.get("KILL_IN_SAVE")
poison_from, fsize_at = int(os.environ.get("POISON_FROM_STEP", 1 << 30)), int(os.environ.get("FSIZE_LIMIT_AT_STEP", -1))

def after_step(self, step):
    if step == kill_at:
        self.checkpointer.wait()
        os.kill(os.getpid(), getattr(signal, os.environ["KILL_SIGNAL"]))
    if step >= poison_from:
        self.state = self.state.replace(params=jax.tree.map(lambda x: x * jnp.nan, self.state.params))
    if step == fsize_at:
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))
loop.Trainer._after_step = after_step

original_finalize = atomicity.AtomicRenameTemporaryPath.finalize
async def finalize(self):
    if self.get_final().name == kill_in_save:
        os.kill(os.getpid(), signal.SIGKILL)
    return await original_finalize(self)
atomicity.AtomicRenameTemporaryPath.finalize = finalize

if __name__ == "__main__":
    app.run(main)
"""


def cli_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu",
               JAX_COMPILATION_CACHE_DIR=os.environ.get("ZAYA_JAX_TEST_CACHE", "/tmp/zaya_jax_jit_cache"),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", PYTHONPATH=REPO, PYTHONUNBUFFERED="1")
    return env


def run_train(workdir, *overrides: str, config: str = "configs/tiny.py", faults: dict | None = None,
              timeout: float = 300) -> subprocess.CompletedProcess:
    """python -m zaya_jax.train (or the fault wrapper) on `config`; returns the finished process."""
    args = ["--config", os.path.join(REPO, config), "--workdir", str(workdir),
            "--config.monitor.progress_bar=False", *overrides]
    env = cli_env()
    if faults:
        env.update({k: str(v) for k, v in faults.items()})
        command = [sys.executable, "-c", WRAPPER, *args]
    else:
        command = [sys.executable, "-m", "zaya_jax.train", *args]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def train_losses(workdir) -> dict[int, float]:
    """{step: loss} from metrics.jsonl; a step logged again after a restart keeps its last loss."""
    losses = {}
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        for line in f:
            record = json.loads(line)
            if record["kind"] == "train":
                losses[record["step"]] = record["loss"]
    return losses
