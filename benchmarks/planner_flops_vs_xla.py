"""The planner's matmul FLOPs per step against XLA's cost_analysis() of the Trainer's compiled
train step on CPU, one device. Prints one JSON row per case; writes
benchmarks/results/planner_flops_vs_xla_cpu.json when it runs them all.

  python benchmarks/planner_flops_vs_xla.py [--case configs/tiny.py capacity dots_no_batch] [--objective dpo]

XLA's cost analysis on CPU counts a while loop's body once, not once per trip, so every case runs
its layers unrolled (model.scan_layers=False) with one loss chunk (train.loss_chunk_size = seq_len)
and one micro-batch; `capacity` and `dense` are the MoE backends whose work XLA can count (the
`tiles` loops have data-dependent trip counts). XLA also counts elementwise FLOPs, which the
planner leaves to its memory-traffic term: the ratio is a little below 1 where they matter.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
from benchmarks.common import print_and_save  # noqa: E402
from zaya_jax.config_files import load_config_file, model_config  # noqa: E402
from zaya_jax.parallel.mesh import MESH_AXES, resolve_mesh_shape  # noqa: E402
from zaya_jax.planner.step_plan import StepShape, _parameters  # noqa: E402
from zaya_jax.planner.step_time import matmul_flops  # noqa: E402
from zaya_jax.train.loop import Trainer  # noqa: E402

CASES = (("configs/tiny.py", "capacity", "dots_no_batch"), ("configs/tiny.py", "dense", "full"),
         ("configs/tiny.py", "capacity", "none"), ("configs/bench_small.py", "capacity", "none"),
         ("configs/bench_small.py", "capacity", "dots_no_batch"))


def countable_config(path: str, moe_backend: str, remat: str):
    """The config with its loops unrolled (see the module docstring) and nothing written but the step."""
    config = load_config_file(path)
    config.model.update(scan_layers=False, moe_backend=moe_backend, remat=remat)
    config.train.update(loss_chunk_size=config.train.seq_len, microbatches=1)
    config.eval.every_steps = 0
    config.checkpoint.every_steps = 0
    config.monitor.update(progress_bar=False, tensorboard=False, heatmap_every_steps=0)
    return config


def xla_flops(config) -> float:
    with tempfile.TemporaryDirectory() as workdir:
        trainer = Trainer(config, workdir)
        try:
            cost = trainer.compiled_step().cost_analysis()
        finally:
            trainer.close()
    return float((cost[0] if isinstance(cost, list) else cost)["flops"])


def planner_flops(config) -> dict[str, float]:
    """Per device, on the config's mesh over this process's devices (as the Trainer lays it out)."""
    cfg = model_config(config)
    mesh = resolve_mesh_shape({a: config.mesh[a] for a in MESH_AXES}, jax.device_count())
    shape = StepShape(config.train.global_batch_size, config.train.seq_len, optimizer=config.optimizer.name,
                      platform="cpu", ns_steps=config.optimizer.muon_ns_steps, loss_chunk=config.train.loss_chunk_size,
                      objective=config.train.objective)
    return matmul_flops(cfg, mesh, shape, _parameters(cfg, mesh))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", nargs=3, action="append", metavar=("CONFIG", "MOE_BACKEND", "REMAT"),
                        help="only these cases, printed and not saved (default: all, saved)")
    parser.add_argument("--objective", default="lm", choices=("lm", "sft", "dpo"),
                        help="train.objective of the cases given with --case (dpo adds the reference model's forward)")
    args = parser.parse_args()
    rows = []
    for path, backend, remat in args.case or CASES:
        config = countable_config(path, backend, remat)
        config.train.objective = args.objective if args.case else "lm"
        ours = planner_flops(config)
        xla = xla_flops(config)
        rows.append({"config": path, "objective": config.train.objective, "moe_backend": backend, "remat": remat,
                     "optimizer": config.optimizer.name,
                     "xla_flops": xla, "planner_flops": sum(ours.values()),
                     "ratio_planner_vs_xla": round(sum(ours.values()) / xla, 4), "planner_by_op": ours})
        print(json.dumps(rows[-1]), flush=True)
    if not args.case:
        print_and_save({"what": "matmul FLOPs per train step, planner vs XLA cost_analysis (CPU, 1 device)",
                        "rows": rows}, "planner_flops_vs_xla_cpu.json")


if __name__ == "__main__":
    main()
