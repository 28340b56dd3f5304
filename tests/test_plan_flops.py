"""The planner's FLOPs per step against XLA's cost_analysis() of the Trainer's compiled train step
on one CPU device, as tests/test_plan.py checks its memory against XLA's memory analysis.

Runs benchmarks/planner/planner_flops_vs_xla.py in a fresh process (one device, not the suite's 8 fake
ones): layers unrolled and one loss chunk, since XLA's cost analysis counts a loop body once.
The tiny case with `dots_no_batch` remat and Muon covers the recomputed scores, convolution and
experts and the Newton-Schulz FLOPs; dpo adds the reference model's forward, grpo (beta > 0) too,
and its loss head on the T completion columns of each row alone; the bench_small cases (ratio
0.977, a two-minute compile here) are in benchmarks/results/planner_flops_vs_xla_cpu.json."""

import json
import os
import subprocess
import sys

import pytest


@pytest.mark.parametrize("objective", ["lm", "dpo", "grpo"])  # dpo, grpo: the reference model's forward too
def test_step_flops_within_ten_percent_of_xla(objective):
    """Within 10% and not above: the planner counts matmuls alone, XLA the elementwise FLOPs too.
    GRPO's loss head computes T of each row's S positions (the completion columns), a T / S share
    of the count over every position (counting all S would put the planner 6% above XLA)."""
    out = subprocess.run([sys.executable, "-m", "benchmarks.planner.planner_flops_vs_xla", "--case", "configs/tiny.py",
                          "capacity", "dots_no_batch", "--objective", objective], capture_output=True, text=True,
                         check=True, env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin", "PYTHONPATH": os.getcwd()})
    row, = [json.loads(line) for line in out.stdout.splitlines() if line.startswith('{"config"')]
    ours = row["planner_by_op"]
    assert ours["loss_head"] > 0 and ours["experts"] > 0 and ours["optimizer/newton_schulz"] > 0
    assert ("reference_model" in ours) == (objective in ("dpo", "grpo"))
    if objective == "grpo":
        step = row["step"]
        assert step["loss_head_len"] < step["seq_len"]
        assert ours["loss_head"] == pytest.approx(row["planner_loss_head_on_every_position"]
                                                  * step["loss_head_len"] / step["seq_len"])
    assert row["planner_flops"] <= row["xla_flops"]
    assert row["planner_flops"] == pytest.approx(row["xla_flops"], rel=0.10)


@pytest.mark.parametrize("layers", [8, 6])
def test_newton_schulz_flops_per_device_are_xlas_for_distributed_muon(layers):
    """The planner's per-device Newton-Schulz count (planner.muon_matrices: the stack spread over 8
    data ranks, the busiest taking ceil(B / 8) matrices) against XLA's cost analysis of the compiled,
    partitioned Muon update on an 8-way data mesh."""
    import jax
    from jax.sharding import AxisType, NamedSharding, PartitionSpec

    from zaya_jax.planner.step_flops import newton_schulz_flops
    from zaya_jax.planner.step_plan import StepShape, muon_matrices
    from zaya_jax.train.optimizer import MUON_MATRICES, distributed_muon
    from zaya_jax.train.settings import OptimizerSettings
    shape = (layers, 3, 16, 24)
    tx = distributed_muon(OptimizerSettings(muon_distributed=True))
    grads = {"layers": {"moe": {"gate": jax.numpy.ones(shape)}}}
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    with jax.set_mesh(mesh):
        g = jax.device_put(grads, NamedSharding(mesh, PartitionSpec()))
        compiled = jax.jit(lambda x: tx.update(x, tx.init(x))[0]).lower(g).compile()
    cost = compiled.cost_analysis()
    xla = (cost[0] if isinstance(cost, list) else cost)["flops"]
    (var_shape, dims, devices), = muon_matrices({"data": 8, "fsdp": 1, "expert": 1, "tensor": 1, "context": 1},
                                               StepShape(8, 64, optimizer="muon", distributed_muon=True),
                                               [(("layers", "moe", "gate"), shape, PartitionSpec())])
    ours = newton_schulz_flops(var_shape, dims.reduction_axis, dims.output_axis, 5) / devices
    assert dims == MUON_MATRICES["layers/moe/gate"] and devices == layers * 3 / -(-layers * 3 // 8)
    assert ours == pytest.approx(xla, rel=0.10), (ours, xla)


@pytest.mark.parametrize("shape,zero1_axis,split", [((2, 3, 16, 24), 2, 8), ((8, 3, 16, 24), 0, 8),
                                                    ((3, 8, 16, 24), 1, 1)])
def test_newton_schulz_flops_per_device_are_xlas_without_distributed_muon(shape, zero1_axis, split):
    """Without optimizer.muon_distributed the partitioner keeps the ZeRO-1 layout of the update on an
    8-way data mesh: where it slices a matrix axis (16 rows) each rank runs Newton-Schulz on its
    slice of every matrix (split 8); where it slices the leading stack axis (8 layers) each rank
    its own matrices (split 8); where it slices a later stack axis (8 experts) the matrices are
    gathered and every rank orthogonalises all of them (split 1). XLA's cost analysis of the
    compiled update against the planner's count (planner.muon_matrices)."""
    import jax
    from jax.sharding import AxisType, NamedSharding, PartitionSpec

    from zaya_jax.parallel.rules import with_zero1_axes
    from zaya_jax.planner.step_flops import newton_schulz_flops
    from zaya_jax.planner.step_plan import StepShape, muon_matrices
    from zaya_jax.train.optimizer import distributed_muon
    from zaya_jax.train.settings import OptimizerSettings
    mesh_shape = {"data": 8, "fsdp": 1, "expert": 1, "tensor": 1, "context": 1}
    zero1 = with_zero1_axes(PartitionSpec(), shape, mesh_shape)
    assert zero1 == PartitionSpec(*[("data" if d == zero1_axis else None) for d in range(4)])
    tx = distributed_muon(OptimizerSettings(muon_distributed=False))
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    with jax.set_mesh(mesh):
        g = jax.device_put({"layers": {"moe": {"gate": jax.numpy.ones(shape)}}}, NamedSharding(mesh, zero1))
        compiled = jax.jit(lambda x: tx.update(x, tx.init(x))[0]).lower(g).compile()
    cost = compiled.cost_analysis()
    xla = (cost[0] if isinstance(cost, list) else cost)["flops"]
    (var_shape, dims, devices), = muon_matrices(mesh_shape, StepShape(8, 64, optimizer="muon",
                                                                      shard_optimizer_over_data=True),
                                               [(("layers", "moe", "gate"), shape, PartitionSpec())])
    assert devices == split
    ours = newton_schulz_flops(var_shape, dims.reduction_axis, dims.output_axis, 5) / devices
    assert ours == pytest.approx(xla, rel=0.10), (ours, xla)
