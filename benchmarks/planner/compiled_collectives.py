"""What the compiled train step of the launch config's model sends, by collective, on XLA:CPU's
SPMD partitioner (the one GPU builds run) over 8 fake devices, beside the planner's count. Prints
JSON; writes benchmarks/results/compiled_collectives_cpu.json.

  python -m benchmarks.planner.compiled_collectives

The model: configs/zaya1_base.py at its real widths, 2 layers, a 4 x 320 batch, on its own mesh
shape (data=-1, context=2: data=4 x context=2), compiled from abstract shapes. Bytes are the
per-device results of the collectives in the compiled HLO (f32; XLA:CPU writes a reduce-scatter
as an all-reduce and a slice). Two cases:

  zero1_group      the gradient all-reduces (rank >= 2) by the number of devices in their
                   replica groups, with the optimizer state sliced over data x context (as
                   shipped, rules.ZERO1_AXES) and over data alone (before)
  muon             the collectives inside the optimizer's update, with optimizer.muon_distributed
                   off and on, and the planner's Muon collectives (planner.step_plan.collectives,
                   ring factor off). 6 experts, so that ZeRO-1 slices a matrix axis of every expert
                   weight, as it does at 1,024 GPUs (40 x 16 stacks divide no 1,024-way group)
"""

from __future__ import annotations

import math
import os
import re

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
from benchmarks.common import print_and_save  # noqa: E402
from zaya_jax.config_files import load_config_file, model_config  # noqa: E402
from zaya_jax.parallel import rules  # noqa: E402
from zaya_jax.parallel.mesh import make_mesh  # noqa: E402
from zaya_jax.planner.step_plan import StepShape, collectives, plan  # noqa: E402
from zaya_jax.train.program import abstract_batch, build_program  # noqa: E402
from zaya_jax.train.settings import settings_from_config  # noqa: E402
from zaya_jax.parallel.rules import with_shardings  # noqa: E402

BATCH, SEQ = 4, 320
_ALL_REDUCE = re.compile(r"= (.*?) all-reduce\(.*?replica_groups=(mesh\[.*?\] \{.*?\}|\[\d+,\d+\]<=\S+|\{\{.*?\}\})")
_MOVES = re.compile(r"= (.*?) (all-gather|all-to-all|collective-permute)(?:-start)?\(.*?op_name=\"([^\"]*)\"")


def launch_config(num_experts: int | None = None, muon_distributed: bool | None = None):
    """configs/zaya1_base.py with 2 layers and a BATCH x SEQ batch (its mesh: data=4 x context=2 on 8 devices)."""
    config = load_config_file("configs/zaya1_base.py")
    config.model.num_layers = 2
    if num_experts is not None:
        config.model.num_experts = num_experts
    if muon_distributed is not None:
        config.optimizer.muon_distributed = muon_distributed
    config.train.update(global_batch_size=BATCH, seq_len=SEQ, steps=100)
    config.optimizer.warmup_steps = 10
    return config


def compiled_step(config, zero1_axes: tuple[str, ...] = rules.ZERO1_AXES) -> str:
    """The compiled train step of `config` (its own mesh and batch) as HLO text, the optimizer state
    sliced over `zero1_axes`."""
    shipped, rules.ZERO1_AXES = rules.ZERO1_AXES, zero1_axes
    try:
        s = settings_from_config(config)
        mesh = make_mesh(s.mesh.sizes)
        program = build_program(s, mesh)
        with jax.set_mesh(mesh):
            return program.train_step.lower(with_shardings(program.abstract_state, program.shardings),
                                            abstract_batch(s.train.global_batch_size, s.train.seq_len),
                                            s.model.rope_theta).compile().as_text()
    finally:
        rules.ZERO1_AXES = shipped


def _f32_bytes(results: str, min_rank: int = 1) -> int:
    return sum(4 * math.prod(int(n) for n in dims.split(","))
               for dims in re.findall(r"f32\[([\d,]+)\]", results) if dims.count(",") + 1 >= min_rank)


def group_size(groups: str) -> int:
    """Devices in one replica group, from HLO's three spellings: mesh['axis_0'=4,'axis_1'=2]
    {'axis_1'} (the named axes reduced), [groups,size]<=[devices] (iota) and {{0,1},{2,3}}."""
    if groups.startswith("mesh"):
        sizes = dict(re.findall(r"'(\w+)'=(\d+)", groups.split("]")[0]))
        return math.prod(int(sizes[a]) for a in re.findall(r"'(\w+)'", groups.split("{")[1]))
    if groups.startswith("["):
        return int(re.match(r"\[\d+,(\d+)\]", groups).group(1))
    return len(re.match(r"\{\{([\d,]*)\}", groups).group(1).split(","))


def gradient_bytes_by_group_size(hlo: str) -> dict[int, int]:
    """{devices in the replica group: bytes} of the all-reduces of rank >= 2 arrays (the gradients)."""
    found: dict[int, int] = {}
    for results, groups in _ALL_REDUCE.findall(hlo):
        size = group_size(groups)
        found[size] = found.get(size, 0) + _f32_bytes(results, min_rank=2)
    return {k: v for k, v in sorted(found.items()) if v}


def optimizer_moves(hlo: str) -> dict[str, int]:
    """{collective: bytes} of the all-gathers, all-to-alls and permutes inside the optimizer's update."""
    sent: dict[str, int] = {}
    for results, kind, op_name in _MOVES.findall(hlo):
        if "/optimizer/" in op_name:
            sent[kind] = sent.get(kind, 0) + _f32_bytes(results)
    return sent


def stacked_dots(hlo: str) -> list[list[int]]:
    """[batch, rows, cols] of the compiled batched f32 dots with a 2,048-wide side (Newton-Schulz
    on the expert weights)."""
    dots = {tuple(map(int, d)) for d in re.findall(r"= f32\[(\d+),(\d+),(\d+)\]\{[\d,]+\} dot\(", hlo)}
    return sorted(list(d) for d in dots if 2048 in d[1:])


def planned_muon(config) -> dict[str, float]:
    """The planner's Muon collectives for `config` on data=4 x context=2, bytes each rank holds
    (the ring factor 7/8 off), by kind."""
    cfg, mesh = model_config(config), {"data": 4, "fsdp": 1, "expert": 1, "tensor": 1, "context": 2}
    shape = StepShape(BATCH, SEQ, optimizer="muon", shard_optimizer_over_data=True,
                      distributed_muon=config.optimizer.muon_distributed)
    return {c.kind: c.bytes / (7 / 8) for c in collectives(cfg, mesh, shape, plan(cfg, mesh, shape)["bytes_per_device"])
            if "Muon" in c.what}


def main():
    zero1 = {"+".join(axes): gradient_bytes_by_group_size(compiled_step(launch_config(), axes))
             for axes in (("data", "context"), ("data",))}
    muon = {}
    for distributed in (False, True):
        config = launch_config(num_experts=6, muon_distributed=distributed)
        hlo = compiled_step(config)
        muon["distributed" if distributed else "not_distributed"] = {
            "optimizer_collective_bytes": optimizer_moves(hlo), "planned_bytes": planned_muon(config),
            "newton_schulz_dots": stacked_dots(hlo)}
    print_and_save({"what": "collective bytes per device per step of the compiled launch-config step "
                            "(zaya1_base, 2 layers, 4 x 320 tokens, data=4 x context=2, XLA:CPU partitioner)",
                    "jax": jax.__version__, "zero1_group_gradient_all_reduce_bytes_by_group_size": zero1,
                    "muon_6_experts": muon}, "compiled_collectives_cpu.json")


if __name__ == "__main__":
    main()
