"""The README's main-job command as a newcomer runs it, timed: a clean clone of HEAD, a new venv,
an empty cache (the demo corpus and the compilation cache built on first use). Prints JSON.

  python -m benchmarks.demos.newcomer_run

The command is read from the README (its bash line that trains configs/demo.py) and run in two
timed parts: everything before `python -m zaya_jax.train` (the venv and `pip install`, from the
package index pip is configured with) and the train command (the corpus build, compilation and
the 260 steps), each with the 1-minute load average at its start and end, since the CPU may be
shared. The venv is made by the Python running this script in place of the line's `python3`
(the line a newcomer whose python3 is that version runs), so the Python 3.11 and 3.12 stacks are
each measured by running the script under them (run_all: newcomer_run_cpu_py311.json, _py312.json);
the demo corpus, and so the final loss, differs between the two. Takes as long as a newcomer waits.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time

from benchmarks.common import REPO  # noqa: E402

from benchmarks.common import stack  # noqa: E402
from zaya_jax.train.monitor import read_metrics  # noqa: E402

TRAIN = " && python -m zaya_jax.train "
VENV = "python3 -m venv "


def readme_main_job(readme: str) -> str:
    """The README's one bash line that installs and trains configs/demo.py."""
    lines = [line for line in readme.splitlines() if TRAIN.strip() in line and "configs/demo.py" in line
             and line.startswith(VENV)]
    if len(lines) != 1:
        raise SystemExit(f"the README has {len(lines)} lines that install and train configs/demo.py; expected 1")
    return lines[0]


def timed(command: str, cwd: str, env: dict) -> dict:
    """Runs `command` under bash; its wall time and the load average at its start and end."""
    load, start = os.getloadavg()[0], time.perf_counter()
    done = subprocess.run(["bash", "-c", command], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"`{command}` failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return {"command": command, "wall_s": round(time.perf_counter() - start, 1),
            "load_average_1m_start_end": [round(load, 2), round(os.getloadavg()[0], 2)]}


def last_logged_loss(workdir: str) -> dict:
    """The last training record of the run's metrics.jsonl (step and loss)."""
    last = read_metrics(os.path.join(workdir, "metrics.jsonl"))[-1]
    return {"step": last["step"], "loss": round(last["loss"], 3)}


def main() -> None:
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
    with tempfile.TemporaryDirectory() as root:
        clone = os.path.join(root, "clone")
        subprocess.run(["git", "clone", "-q", REPO, clone], check=True)
        with open(os.path.join(clone, "README.md")) as f:  # the committed README, as the newcomer reads it
            install, train = readme_main_job(f.read()).split(TRAIN)
        env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
        env.update(ZAYA_JAX_CACHE=os.path.join(root, "cache"), PATH=os.pathsep.join(
            p for p in env["PATH"].split(os.pathsep) if not p.startswith(REPO)))
        base_python = getattr(sys, "_base_executable", sys.executable)  # the interpreter under this venv
        installed = timed(install.replace(VENV, f"{base_python} -m venv ", 1), clone, env)
        trained = timed(f". .venv/bin/activate{TRAIN}{train}", clone, env)
        workdir = re.search(r"--workdir (\S+)", train)[1]
        loss = last_logged_loss(os.path.join(clone, workdir))
    print(json.dumps({"commit": head, "cpu_count": os.cpu_count(), "stack": stack(), "readme_line": install,
                      "install": installed, "train": trained, "last_logged": loss,
                      "total_s": round(installed["wall_s"] + trained["wall_s"], 1)}, indent=2))


if __name__ == "__main__":
    main()
