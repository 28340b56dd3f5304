"""The planner's FLOPs per step against XLA's cost_analysis() of the Trainer's compiled train step
on one CPU device, as tests/test_plan.py checks its memory against XLA's memory analysis.

Runs benchmarks/planner_flops_vs_xla.py in a fresh process (one device, not the suite's 8 fake
ones): layers unrolled and one loss chunk, since XLA's cost analysis counts a loop body once.
The tiny case with `dots_no_batch` remat and Muon covers the recomputed scores, convolution and
experts and the Newton-Schulz FLOPs; the bench_small cases (ratio 0.977, a two-minute compile
here) are in benchmarks/results/planner_flops_vs_xla_cpu.json."""

import json
import os
import subprocess
import sys

import pytest


@pytest.mark.parametrize("objective", ["lm", "dpo"])  # dpo: the reference model's forward too
def test_step_flops_within_ten_percent_of_xla(objective):
    out = subprocess.run([sys.executable, "benchmarks/planner_flops_vs_xla.py", "--case", "configs/tiny.py",
                          "capacity", "dots_no_batch", "--objective", objective], capture_output=True, text=True,
                         check=True, env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin", "PYTHONPATH": os.getcwd()})
    row, = [json.loads(line) for line in out.stdout.splitlines() if line.startswith('{"config"')]
    ours = row["planner_by_op"]
    assert ours["loss_head"] > 0 and ours["experts"] > 0 and ours["optimizer/newton_schulz"] > 0
    assert ("reference_model" in ours) == (objective == "dpo")
    assert row["planner_flops"] == pytest.approx(row["xla_flops"], rel=0.10)
