"""The planner's FLOPs per step against XLA's cost_analysis() of the Trainer's compiled train step
(CPU, one device), as tests/test_plan.py checks its memory against XLA's memory analysis.

The cases run unrolled with one loss chunk (XLA's cost analysis counts a loop body once; see
benchmarks/planner_flops_vs_xla.py, whose helpers these are)."""

import importlib.util
import pathlib

import pytest

_spec = importlib.util.spec_from_file_location("planner_flops_vs_xla",
                                               pathlib.Path("benchmarks/planner_flops_vs_xla.py"))
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


@pytest.mark.parametrize("path, backend, remat", [
    ("configs/tiny.py", "capacity", "dots_no_batch"),    # Muon; recomputed scores, convolution and experts
    ("configs/bench_small.py", "capacity", "none"),      # AdamW; wider layers
])
def test_step_flops_within_ten_percent_of_xla(path, backend, remat):
    config = bench.countable_config(path, backend, remat)
    ours = bench.planner_flops(config)
    xla = bench.xla_flops(config)
    assert ours["loss_head"] > 0 and ours["experts"] > 0
    assert sum(ours.values()) == pytest.approx(xla, rel=0.10)
