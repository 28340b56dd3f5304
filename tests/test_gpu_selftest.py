"""The GPU self-test on a machine without a GPU: says what it would run, writes nothing, exits 0."""

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_selftest_without_a_gpu_prints_its_plan(tmp_path):
    out = tmp_path / "result.json"
    run = subprocess.run([sys.executable, "-m", "benchmarks.gpu_selftest", "--out", str(out)], cwd=REPO,
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO})
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    assert report["gpu"] is False and report["backend"] == "cpu"
    assert set(report["would_run"]) == {"kernels", "attention", "moe", "proxy"}
    assert set(report["would_run"]["moe"]["paths"]) == {"ragged_dot", "ragged_dot_grouped_gemm_flag",
                                                        "pallas_grouped_matmul", "capacity_1.25"}
    assert not out.exists()
