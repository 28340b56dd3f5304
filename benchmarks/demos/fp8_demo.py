"""The README's demo trained with FP8 matmuls against the same demo in bf16. Prints JSON; writes
benchmarks/results/fp8_demo_cpu_py311.json (or _py312).

  python -m benchmarks.demos.fp8_demo [--steps N]   (default: the config's, 260)

Both runs are configs/demo.py with model.dtype=bfloat16; the FP8 run adds
model.matmul_precision=fp8 (zaya_jax.model.fp8: the expert and CCA projection matmuls in e4m3
with e5m2 gradients, OCP formats on CPU, where XLA computes the FP8 dot in a wider type, so the
numbers are the formats' rounding, not an FP8 unit's speed). Reported: the last logged training
loss (a mean over the last 10 steps' batches is what the loop logs) and the final held-out loss
per source of each, and the FP8 run's relative difference from bf16's. Wall times are not a
speed claim (CPU, shared: load averages beside them).
"""

from __future__ import annotations

import argparse
import os

from benchmarks.common import REPO, print_and_save, stack, stack_suffix  # noqa: E402
from benchmarks.demos.demo_run import train_demo  # noqa: E402
from zaya_jax.config_files import load_config_file  # noqa: E402


def run(precision: str, steps: int) -> dict:
    config = load_config_file(os.path.join(REPO, "configs", "demo.py"))
    config.model.update(dtype="bfloat16", matmul_precision=precision)
    if steps:
        config.train.steps = steps
    load_start = os.getloadavg()[0]
    wall, train, evals = train_demo(config)
    return {"matmul_precision": precision, "steps": train[-1]["step"], "wall_s_including_compile": round(wall, 1),
            "last_logged_loss": round(train[-1]["loss"], 4),
            "final_eval_loss": {k.split("/")[1]: round(v, 4) for k, v in evals[-1].items() if k.endswith("/loss")},
            "load_average_1m_start_end": [round(load_start, 2), round(os.getloadavg()[0], 2)]}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=0, help="0: the config's train.steps")
    args = parser.parse_args()
    bf16, fp8 = run("default", args.steps), run("fp8", args.steps)
    result = {"stack": stack(), "config": "demo.py, model.dtype=bfloat16", "bf16": bf16, "fp8": fp8,
              "last_logged_loss_rel_diff": round(fp8["last_logged_loss"] / bf16["last_logged_loss"] - 1, 4),
              "final_eval_loss_rel_diff": {k: round(v / bf16["final_eval_loss"][k] - 1, 4)
                                           for k, v in fp8["final_eval_loss"].items()},
              "cpu_count": os.cpu_count()}
    print_and_save(result, f"fp8_demo_cpu_{stack_suffix()}.json")


if __name__ == "__main__":
    main()
