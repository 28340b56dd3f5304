"""The README's demo: `python -m zaya_jax.train --config configs/demo.py`, measured. Prints JSON.

  python -m benchmarks.demos.demo_run [--steps N]   (default: the config's, 260)

Runs the Trainer on configs/demo.py in a temporary workdir (the demo corpus cache is the usual
one: a first run also builds it) and reports the wall time including compilation, the first and
last logged training loss and router entropy, the phases seen and the final held-out loss per
source, with the load average at start and end (the CPU may be shared), and the stack (Python, jax):
the demo corpus, and so the losses, differ between Python 3.11 and 3.12 (its code source is that
Python's standard library; run_all writes demo_run_cpu_py311.json and _py312.json).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time

from absl import flags  # noqa: E402

if not flags.FLAGS.is_parsed():  # Grain reads absl flags
    flags.FLAGS.mark_as_parsed()

from benchmarks.common import REPO, stack  # noqa: E402
from zaya_jax.config_files import load_config_file  # noqa: E402
from zaya_jax.train.loop import Trainer  # noqa: E402
from zaya_jax.train.monitor import read_metrics  # noqa: E402


def train_demo(config) -> tuple[float, list[dict], list[dict]]:
    """Trains `config` in a temporary workdir -> (wall seconds including compilation, the logged
    training records, the eval records)."""
    config.monitor.update(progress_bar=False, tensorboard=False)
    with tempfile.TemporaryDirectory() as workdir, contextlib.redirect_stdout(sys.stderr):
        start = time.perf_counter()
        trainer = Trainer(config, workdir)
        try:
            trainer.run()
        finally:
            trainer.close()
        wall = time.perf_counter() - start
        train = read_metrics(os.path.join(workdir, "metrics.jsonl"))
        evals = read_metrics(os.path.join(workdir, "metrics.jsonl"), kind="eval")
    return wall, train, evals


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=0, help="0: the config's train.steps")
    args = parser.parse_args()
    load_start = os.getloadavg()[0]
    config = load_config_file(os.path.join(REPO, "configs", "demo.py"))
    if args.steps:
        config.train.steps = args.steps
    wall, train, evals = train_demo(config)
    final_eval = {k.split("/")[1]: round(v, 3) for k, v in evals[-1].items() if k.endswith("/loss")}
    print(json.dumps({
        "stack": stack(), "config": "demo.py", "steps": train[-1]["step"], "wall_s_including_compile": round(wall, 1),
        "first_logged": {"step": train[0]["step"], "loss": round(train[0]["loss"], 3),
                         "router_entropy": round(train[0]["router_entropy"], 3)},
        "last_logged": {"step": train[-1]["step"], "loss": round(train[-1]["loss"], 3),
                        "router_entropy": round(train[-1]["router_entropy"], 3)},
        "phases": sorted({r["phase"] for r in train}), "final_eval_loss": final_eval,
        "eval_step": evals[-1]["step"], "cpu_count": os.cpu_count(),
        "load_average_1m_start_end": [round(load_start, 2), round(os.getloadavg()[0], 2)],
    }, indent=2))


if __name__ == "__main__":
    main()
