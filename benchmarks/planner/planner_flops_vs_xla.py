"""The planner's matmul FLOPs per step against XLA's cost_analysis() of the Trainer's compiled
train step on CPU, one device. Prints one JSON row per case; writes
benchmarks/results/planner_flops_vs_xla_cpu.json when it runs them all.

  python -m benchmarks.planner.planner_flops_vs_xla [--case configs/tiny.py capacity dots_no_batch] [--objective grpo]

The step is the one the Trainer runs (zaya_jax.train.program.build_program's, compiled for the
first phase's batch as Trainer.compiled_step does), compiled from shapes alone: no state is
allocated and no data opened. XLA's cost analysis on CPU counts a while loop's body once, not
once per trip, so every case runs its layers unrolled (model.scan_layers=False) with one loss
chunk (train.loss_chunk_size = seq_len) and one micro-batch; `capacity` and `dense` are the MoE
backends whose work XLA can count (the `tiles` loops have data-dependent trip counts). XLA also
counts elementwise FLOPs, which the planner leaves to its memory-traffic term: the ratio is a
little below 1 where they matter.

--objective grpo gives the case's config a grpo section (GRPO_SECTION): its batch is
prompts_per_step x num_generations rows of S = max_prompt_length + max_completion_length - 1
positions (the config's global batch and seq_len), its loss head computes the T =
max_completion_length completion columns of each row, and beta > 0 runs the frozen reference
model's forward too. Its row adds planner_loss_head_on_every_position: the planner's loss head
over all S positions of each row, which the T it counts must be the T / S fraction of.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import ml_collections  # noqa: E402
from benchmarks.common import print_and_save  # noqa: E402
from zaya_jax.config_files import load_config_file, model_config  # noqa: E402
from zaya_jax.parallel.mesh import MESH_AXES, make_mesh, resolve_mesh_shape  # noqa: E402
from zaya_jax.planner.phase_plan import config_phases, grpo_step_fields  # noqa: E402
from zaya_jax.planner.step_plan import StepShape, _parameters  # noqa: E402
from zaya_jax.planner.step_time import matmul_flops  # noqa: E402
from zaya_jax.train.program import abstract_batch, build_program, image_shape  # noqa: E402
from zaya_jax.train.settings import GRPOSettings, settings_from_config  # noqa: E402
from zaya_jax.parallel.rules import with_shardings  # noqa: E402

CASES = (("configs/tiny.py", "capacity", "dots_no_batch"), ("configs/tiny.py", "dense", "full"),
         ("configs/tiny.py", "capacity", "none"), ("configs/bench_small.py", "capacity", "none"),
         ("configs/bench_small.py", "capacity", "dots_no_batch"))


# --objective grpo: 4 completions of each of 2 prompts (the 8 rows of tiny's batch) of
# Q + T - 1 = 49 + 16 - 1 = 64 positions (its seq_len): the loss head on T / S = 1/4 of them
GRPO_SECTION = dict(num_generations=4, prompts_per_step=2, max_prompt_length=49, max_completion_length=16,
                    beta=0.04)


def countable_config(path: str, moe_backend: str, remat: str, objective: str = "lm"):
    """The config with its loops unrolled (see the module docstring) and nothing written but the step;
    for objective grpo with a grpo section (GRPO_SECTION) whose rows are its global batch and seq_len."""
    config = load_config_file(path)
    config.model.update(scan_layers=False, moe_backend=moe_backend, remat=remat)
    config.train.update(loss_chunk_size=config.train.seq_len, microbatches=1, objective=objective)
    config.eval.every_steps = 0
    config.checkpoint.every_steps = 0
    config.monitor.update(progress_bar=False, tensorboard=False, heatmap_every_steps=0)
    if objective == "grpo":
        config.grpo = ml_collections.ConfigDict({**dataclasses.asdict(GRPOSettings()), **GRPO_SECTION})
        phase, = config_phases(config)
        assert (phase.global_batch_size, phase.seq_len) == (config.train.global_batch_size, config.train.seq_len)
    return config


def xla_flops(config) -> float:
    """XLA's FLOPs of the Trainer's train step (Trainer.compiled_step's program, from shapes alone)."""
    settings = settings_from_config(config)
    phase = config_phases(config)[0]
    mesh = make_mesh(settings.mesh.sizes)
    program = build_program(settings, mesh)
    state = with_shardings(program.abstract_state, program.shardings)
    batch = abstract_batch(phase.global_batch_size, phase.seq_len, image_shape(settings),
                           program.objective.extra_batch_keys)
    cost = program.train_step.lower(state, batch, phase.rope_theta).compile().cost_analysis()
    return float((cost[0] if isinstance(cost, list) else cost)["flops"])


def step_shape(config) -> StepShape:
    """The planner's shape of the config's first phase (a GRPO config's: its grpo section's)."""
    phase = config_phases(config)[0]
    return StepShape(phase.global_batch_size, phase.seq_len, optimizer=config.optimizer.name, platform="cpu",
                     ns_steps=config.optimizer.muon_ns_steps, loss_chunk=config.train.loss_chunk_size,
                     objective=config.train.objective, **grpo_step_fields(config))


def planner_flops(config, shape: StepShape) -> dict[str, float]:
    """Per device, on the config's mesh over this process's devices (as the Trainer lays it out)."""
    cfg = model_config(config)
    mesh = resolve_mesh_shape({a: config.mesh[a] for a in MESH_AXES}, jax.device_count())
    return matmul_flops(cfg, mesh, shape, _parameters(cfg, mesh))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", nargs=3, action="append", metavar=("CONFIG", "MOE_BACKEND", "REMAT"),
                        help="only these cases, printed and not saved (default: all, saved)")
    parser.add_argument("--objective", default="lm", choices=("lm", "sft", "dpo", "grpo"),
                        help="train.objective of the cases given with --case (dpo adds the reference model's "
                             "forward; grpo too, and its loss head on the completion columns alone)")
    args = parser.parse_args()
    rows = []
    for path, backend, remat in args.case or CASES:
        config = countable_config(path, backend, remat, args.objective if args.case else "lm")
        shape = step_shape(config)
        ours = planner_flops(config, shape)
        xla = xla_flops(config)
        rows.append({"config": path, "objective": config.train.objective, "moe_backend": backend, "remat": remat,
                     "optimizer": config.optimizer.name,
                     "xla_flops": xla, "planner_flops": sum(ours.values()),
                     "ratio_planner_vs_xla": round(sum(ours.values()) / xla, 4), "planner_by_op": ours,
                     "step": {k: getattr(shape, k) for k in ("global_batch", "seq_len", "loss_head_len")}})
        if shape.loss_head_positions:
            every = planner_flops(config, dataclasses.replace(shape, loss_head_positions=0))["loss_head"]
            rows[-1]["planner_loss_head_on_every_position"] = every
        print(json.dumps(rows[-1]), flush=True)
    if not args.case:
        print_and_save({"what": "matmul FLOPs per train step, planner vs XLA cost_analysis (CPU, 1 device)",
                        "rows": rows}, "planner_flops_vs_xla_cpu.json")


if __name__ == "__main__":
    main()
