"""The GPU self-test on a machine without a GPU: says what it would run, writes nothing, exits 0;
the calibration file it writes on a GPU is one the planner's --calibration reads."""

import json
import os
import subprocess
import sys

import pytest

from benchmarks import gpu_calibration
from zaya_jax.config_files import load_config_file, model_config
from zaya_jax.parallel.hardware import PROFILES, calibrated
from zaya_jax.parallel.mesh import resolve_mesh_shape
from zaya_jax.parallel.phase_plan import config_phases, phase_shape, plan_phase
from zaya_jax.parallel.planner import StepShape

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_selftest_without_a_gpu_prints_its_plan(tmp_path):
    out = tmp_path / "result.json"
    run = subprocess.run([sys.executable, "-m", "benchmarks.gpu_selftest", "--out", str(out)], cwd=REPO,
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO})
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    assert report["gpu"] is False and report["backend"] == "cpu"
    assert set(report["would_run"]) == {"calibration", "kernels", "attention", "moe", "proxy"}
    assert set(report["would_run"]["moe"]["paths"]) == {"ragged_dot", "ragged_dot_grouped_gemm_flag",
                                                        "pallas_grouped_matmul", "capacity_1.25"}
    assert not out.exists()


def test_calibration_file_is_read_by_the_planner(tmp_path):
    """The self-test's calibration writer, fed a measurement dict as gpu_calibration.measure()
    returns it (one rate failed, no inter-node rate), writes a file the planner's --calibration
    loader accepts: measured rates replace the assumed ones, the rest stay the profile's."""
    measured = {"device_kind": "AMD Instinct MI300X", "matmul": {"tflops": 512.3456},
                "hbm": {"error": "RuntimeError: out of memory"}, "all_reduce": {"gbps": 200.0, "devices": 8}}
    path = tmp_path / "gpu_calibration_rocm.json"
    gpu_calibration.write(measured, str(path))
    assert json.loads(path.read_text()) == {"device_kind": "AMD Instinct MI300X", "matmul_tflops": 512.3,
                                            "intra_node_gbps": 200.0}
    base = PROFILES["mi300x"]
    hw = calibrated(base, str(path))
    assert (hw.efficiency.hbm, hw.efficiency.inter_node) == (base.efficiency.hbm, base.efficiency.inter_node)

    config = load_config_file(os.path.join(REPO, "configs/zaya1_base.py"))
    cfg = model_config(config)
    shape = phase_shape(StepShape(1, 1, optimizer="muon", shard_optimizer_over_data=True), config_phases(config)[0])
    mesh = resolve_mesh_shape({"data": 512, "tensor": 2}, 1024)  # a tensor all-reduce inside the node
    before, after = (plan_phase(cfg, shape, mesh, h, h.memory_gb)["prediction"] for h in (base, hw))
    assert after["compute_s"] == pytest.approx(sum(after["flops_per_device"].values()) / 512.3e12)
    assert after["memory_s"] == pytest.approx(before["memory_s"])
    tensor = [(b["seconds"], a["seconds"]) for b, a in zip(before["collectives"], after["collectives"])
              if a["axis"] == "tensor"]
    assert tensor and all(a == pytest.approx(b * 448.0 * base.efficiency.intra_node / 200.0) for b, a in tensor)
    assert after["step_s"] != pytest.approx(before["step_s"])
