"""Running the training CLI in a subprocess, optionally with an injected fault.

Faults are injected from outside the product code: a wrapper script patches the loop's
per-step seam (Trainer._after_step) or Orbax's final rename, then runs the CLI's main.
  KILL_AT_STEP=n KILL_SIGNAL=SIGKILL|SIGTERM   signal this process after step n (once the
                                               checkpoints started so far, local tier's included,
                                               are on disk)
  KILL_IN_SAVE=n                               SIGKILL while checkpoint n is being written (after
                                               its data, before Orbax renames it into place)
  KILL_AFTER_COMMIT=n                          SIGKILL the instant Orbax has renamed checkpoint n
                                               into place (its commit), in the commit's own thread
  POISON_FROM_STEP=n                           parameters set to NaN after every step >= n (the
                                               next step is non-finite, every time)
  FSIZE_LIMIT_AT_STEP=n                        after step n, files of this process may not grow
                                               past 100 kB (RLIMIT_FSIZE: writes fail with EFBIG,
                                               as on a full disk)
  READ_ONLY_AT_STEP=n                          after step n (once the checkpoints started so far
                                               are on disk), WORKDIR/checkpoints gets mode 0555
                                               (binding only without root's DAC override: run
                                               with run_train(..., unprivileged=True))
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

from tests.fake_devices import COMPILATION_CACHE, RUNTIME_BOUND, xla_flags
from zaya_jax.errors import EXIT_PREEMPTED

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WRAPPER = r"""
import os, resource, signal
import jax, jax.numpy as jnp
from absl import app
from orbax.checkpoint._src.path import atomicity
from zaya_jax.train import loop
from zaya_jax.train.__main__ import main

kill_at, kill_in_save = int(os.environ.get("KILL_AT_STEP", -1)), os.environ.get("KILL_IN_SAVE")
kill_after_commit = os.environ.get("KILL_AFTER_COMMIT")
poison_from, fsize_at = int(os.environ.get("POISON_FROM_STEP", 1 << 30)), int(os.environ.get("FSIZE_LIMIT_AT_STEP", -1))
read_only_at = int(os.environ.get("READ_ONLY_AT_STEP", -1))

def after_step(self, step):
    if step == kill_at:
        self.checkpointer.wait()
        if self.local_tier:
            self.local_tier.wait()
        os.kill(os.getpid(), getattr(signal, os.environ["KILL_SIGNAL"]))
    if step >= poison_from:
        self.state = self.state.replace(params=jax.tree.map(lambda x: x * jnp.nan, self.state.params))
    if step == fsize_at:
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))
    if step == read_only_at:
        self.checkpointer.wait()
        os.chmod(self.checkpointer.directory, 0o555)
loop.Trainer._after_step = after_step

original_finalize = atomicity.AtomicRenameTemporaryPath.finalize
async def finalize(self):
    if self.get_final().name == kill_in_save:
        os.kill(os.getpid(), signal.SIGKILL)
    committed = await original_finalize(self)
    if self.get_final().name == kill_after_commit:
        os.kill(os.getpid(), signal.SIGKILL)
    return committed
atomicity.AtomicRenameTemporaryPath.finalize = finalize

if __name__ == "__main__":
    app.run(main)
"""


def cli_env(cheap_compile: bool = True) -> dict[str, str]:
    """The environment of a CLI subprocess: 8 fake devices, the suite's compilation cache (fake_devices.xla_flags)."""
    env = dict(os.environ)
    env.update(XLA_FLAGS=xla_flags(8, cheap_compile), JAX_PLATFORMS="cpu",
               JAX_COMPILATION_CACHE_DIR=COMPILATION_CACHE,
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", PYTHONPATH=REPO, PYTHONUNBUFFERED="1")
    return env


def without_dac_override() -> None:
    """A subprocess's preexec_fn: when run by root, the child loses CAP_DAC_OVERRIDE and
    CAP_DAC_READ_SEARCH (dropped from its capability bounding set, so the program it executes never
    gains them), so that file modes bind it as they bind any other user; otherwise nothing."""
    if os.geteuid() != 0:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    for capability in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH (linux/capability.h)
        if libc.prctl(24, capability, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def run_train(workdir, *overrides: str, config: str = "configs/tiny.py", faults: dict | None = None,
              timeout: float = 300, unprivileged: bool = False) -> subprocess.CompletedProcess:
    """python -m zaya_jax.train (or the fault wrapper) on `config`; returns the finished process.
    `unprivileged`: file modes bind the process even when it runs as root (without_dac_override)."""
    args = ["--config", os.path.join(REPO, config), "--workdir", str(workdir),
            "--config.monitor.progress_bar=False", *overrides]
    env = cli_env(cheap_compile=config not in RUNTIME_BOUND)
    if faults:
        env.update({k: str(v) for k, v in faults.items()})
        command = [sys.executable, "-c", WRAPPER, *args]
    else:
        command = [sys.executable, "-m", "zaya_jax.train", *args]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout,
                          preexec_fn=without_dac_override if unprivileged else None)


def uninterrupted_losses(workdir, *overrides: str) -> dict[int, float]:
    """A run of configs/tiny.py with `overrides` that must end well -> its {step: loss}."""
    result = run_train(workdir, *overrides)
    assert result.returncode == 0, result.stderr[-3000:]
    return train_losses(workdir)


def train_losses(workdir) -> dict[int, float]:
    """{step: loss} from metrics.jsonl; a step logged again after a restart keeps its last loss."""
    losses = {}
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        for line in f:
            record = json.loads(line)
            if record["kind"] == "train":
                losses[record["step"]] = record["loss"]
    return losses


# -- damaged checkpoints: variant -> (damage a step directory, the reason a restore names) ---------------

def _blob(step_dir, item):
    """The largest array blob of `item` (an OCDBT data file; a local tier step's shard files have no OCDBT)."""
    files = [os.path.join(root, n) for root, _, names in os.walk(os.path.join(step_dir, item)) for n in names]
    return max([f for f in files if os.sep + "d" + os.sep in f] or files, key=os.path.getsize)


def empty_folder(step_dir):
    for entry in os.listdir(step_dir):
        shutil.rmtree(os.path.join(step_dir, entry), ignore_errors=True)
        if os.path.exists(os.path.join(step_dir, entry)):
            os.remove(os.path.join(step_dir, entry))


def _delete_model_item(step_dir):
    shutil.rmtree(os.path.join(step_dir, "model"))


def _truncate_model_blob(step_dir):
    path = _blob(step_dir, "model")
    os.truncate(path, os.path.getsize(path) // 2)


def flip_model_bytes(step_dir):
    flip_bytes_of_item(step_dir, "model")


def flip_bytes_of_item(step_dir, item):
    """Inverts 16 bytes in the middle of `item`'s largest array blob."""
    path = _blob(step_dir, item)
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        chunk = f.read(16)
        f.seek(os.path.getsize(path) // 2)
        f.write(bytes(b ^ 0xFF for b in chunk))


def _garbage_config_json(step_dir):
    with open(os.path.join(step_dir, "config", "metadata"), "w") as f:
        f.write('{"model": {"hidden_size": 64,, garbage')


DAMAGE = {  # variant -> (damage, the reason the loader names)
    "empty folder": (empty_folder, "no zaya_manifest.json"),
    "deleted item": (_delete_model_item, "item 'model' is missing"),
    "truncated blob": (_truncate_model_blob, r"model/.* has \d+ bytes, \d+ were written"),
    "flipped bytes": (flip_model_bytes, "model/.* fails its checksum"),
    "garbage json": (_garbage_config_json, "config/metadata (has|fails)"),
}


# -- two processes -------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


GLOO_CONNECT_FAILURE = "Gloo context initialization failed"  # gloo's fixed 30 s wait for the peers, run out
STOP_LIMIT_S = 10  # a stop's promise: both processes exit this soon once the step in flight has finished
TINY_TOKENS_PER_STEP = 8 * 64  # configs/tiny.py: global_batch_size x seq_len


class OverloadedHarness(RuntimeError):
    """A job's processes missed gloo's fixed 30 s first-connect wait for each other: the test machine's
    load (two multi-process jobs, or a job beside heavy tests, on 2 cores), not the code under test.
    The multi-process tests are re-run on it, and only on it (pytest-rerunfailures' only_rerun)."""


RERUN_IF_OVERLOADED = dict(reruns=2, only_rerun=["OverloadedHarness"])  # for @pytest.mark.flaky


class Job:
    """`python -m zaya_jax.train` as 2 processes of one jax.distributed job (launch/local.sh's environment)."""

    def __init__(self, workdir, *overrides, devices_per_process: int = 1, faults: dict | None = None,
                 config: str = "configs/tiny.py"):
        """`faults`: the fault wrapper's environment (see above), for process 0 only."""
        self.workdir, port = workdir, free_port()
        self.logs = [open(workdir.parent / f"{workdir.name}.{i}.log", "w+") for i in range(2)]
        self.processes = []
        for i in range(2):
            env = {**cli_env(), "ZAYA_COORDINATOR": f"127.0.0.1:{port}", "ZAYA_NUM_PROCESSES": "2",
                   "ZAYA_PROCESS_ID": str(i), "XLA_FLAGS": xla_flags(devices_per_process)}
            entry = ["-m", "zaya_jax.train"]
            if faults and i == 0:
                env.update({k: str(v) for k, v in faults.items()})
                entry = ["-c", WRAPPER]
            command = [sys.executable, *entry, "--config", config, "--workdir", str(workdir),
                       "--config.monitor.progress_bar=False", *overrides]
            self.processes.append(subprocess.Popen(command, cwd=REPO, env=env, stdout=self.logs[i],
                                                   stderr=subprocess.STDOUT))

    def output(self, i: int) -> str:
        self.logs[i].seek(0)
        return self.logs[i].read()

    def wait_for(self, text: str, process: int = 0, timeout: float = 240) -> None:
        deadline = time.time() + timeout
        while text not in self.output(process):
            self.check_running(deadline, f"never printed {text!r}")
            time.sleep(0.05)

    def wait_for_step(self, beyond: int) -> None:
        """Until process 0 logs a train record past step `beyond`."""
        deadline = time.time() + 240
        while not self._logged_beyond(beyond):
            self.check_running(deadline, f"never logged a step past {beyond}")
            time.sleep(0.05)

    def check_running(self, deadline: float, waiting_for: str) -> None:
        """Raises, while waiting for `waiting_for`, if a process ended or `deadline` passed:
        OverloadedHarness when gloo gave up connecting, else AssertionError with both outputs."""
        if all(p.poll() is None for p in self.processes) and time.time() < deadline:
            return
        self._raise_if_overloaded()
        raise AssertionError(f"{waiting_for}:\n" + self.output(0)[-3000:] + self.output(1)[-3000:])

    def _raise_if_overloaded(self) -> None:
        for i in range(2):
            if GLOO_CONNECT_FAILURE in self.output(i):
                raise OverloadedHarness(f"process {i}: {GLOO_CONNECT_FAILURE} (the test machine's load)")

    def stop_limit_s(self) -> float:
        """How soon both processes must exit after a stop signal: STOP_LIMIT_S once the step in flight
        has finished, i.e. plus the slowest step process 0 logged (a loaded machine slows every step)."""
        with open(os.path.join(self.workdir, "metrics.jsonl")) as f:
            rates = [r["tokens_per_sec"] for r in map(json.loads, f) if r["kind"] == "train"]
        return STOP_LIMIT_S + max((TINY_TOKENS_PER_STEP / rate for rate in rates), default=0.0)

    def _logged_beyond(self, beyond: int) -> bool:
        try:
            return max(train_losses(self.workdir), default=-1) > beyond
        except (FileNotFoundError, json.JSONDecodeError):  # not yet written, or a line half written
            return False

    def signal(self, process: int, signum=signal.SIGTERM) -> None:
        self.processes[process].send_signal(signum)

    def finish(self, timeout: float = 60) -> tuple[list[int], float]:
        """(exit codes, seconds from now until both exited); OverloadedHarness when gloo gave up connecting."""
        start = time.time()
        codes = [p.wait(timeout=timeout) for p in self.processes]
        seconds = time.time() - start
        if any(code not in (0, EXIT_PREEMPTED, -signal.SIGKILL) for code in codes):
            self._raise_if_overloaded()
        return codes, seconds
