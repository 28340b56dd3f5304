"""The GPU self-test on a machine without a GPU: says what it would run, writes nothing, exits 0;
its sections run in processes of their own and a hung one is killed on time; the proxy's mesh
resolves on 1, 2 and 8 GPUs and its per-layer MFU is the difference of two depths; the carried
wheels and the lent image hold every dependency; the calibration file it writes on a GPU is one the
planner's --calibration reads."""

import json
import os
import re
import subprocess
import sys
import time
import tomllib

import jax
import pytest
from packaging.requirements import Requirement

from benchmarks.gpu import gpu_calibration, gpu_proxy, gpu_selftest
from zaya_jax.config import ConfigError
from zaya_jax.config_files import load_config_file, model_config
from zaya_jax.hardware import PROFILES, calibrated
from zaya_jax.parallel.mesh import resolve_mesh_shape
from zaya_jax.planner.phase_plan import config_phases, phase_shape, plan_phase
from zaya_jax.planner.step_plan import StepShape
from zaya_jax.train.settings import check_batch_layout, settings_from_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_selftest_without_a_gpu_prints_its_plan(tmp_path):
    out = tmp_path / "result.json"
    run = subprocess.run([sys.executable, "-m", "benchmarks.gpu.gpu_selftest", "--out", str(out)], cwd=REPO,
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO})
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    assert report["gpu"] is False and report["backend"] == "cpu"
    assert report["environment"]["versions"]["jax"] == jax.__version__  # the environment section's own process
    assert report["preflight"] == {"missing": [], "other_versions": {}}
    timeouts = report["would_run"]["sections"]
    assert list(timeouts)[:4] == ["environment", "proxy_adamw_2", "proxy_adamw_4", "proxy_muon_4"]  # proxy first
    assert sum(timeouts.values()) <= 9 * 60
    assert set(report["would_run"]["moe"]["paths"]) == {"ragged_dot", "pallas_grouped_matmul", "capacity_1.25"}
    assert not out.exists()


@pytest.mark.parametrize("devices", [1, 2, 8])
def test_the_proxy_mesh_resolves_on_1_2_and_8_gpus(devices):
    """What the old proxy could not (zaya1_base's context=2 on one GPU): the trainer's own checks pass."""
    config = gpu_proxy.config_for(4, "adamw", devices)
    settings = settings_from_config(config)
    mesh = resolve_mesh_shape(dict(settings.mesh.sizes), devices)
    assert mesh["data"] == devices and all(n == 1 for a, n in mesh.items() if a != "data")
    check_batch_layout(config.train.global_batch_size, config.train.seq_len, settings.train.microbatches, mesh, "proxy")
    cfg = model_config(config)
    base = model_config(load_config_file(os.path.join(REPO, "configs/zaya1_base.py")))
    assert cfg == base.replace(num_layers=4)  # ZAYA1-base widths, vocabulary and heads
    if devices == 1:
        with pytest.raises(ConfigError, match="cannot fill 1 devices"):
            resolve_mesh_shape(dict(settings_from_config(load_config_file(
                os.path.join(REPO, "configs/zaya1_base.py"))).mesh.sizes), 1)


def test_per_layer_mfu_is_the_difference_of_two_depths():
    """Hand numbers: 2 layers take 1.0 s, 4 layers 1.6 s; each layer adds 100 TFLOP; the peak is 1,000
    TFLOP/s (recovered from the deeper run's MFU); Muon adds 0.25 s."""
    runs = {"adamw_2": {"layers": 2, "step_s": 1.0, "model_flops_per_step": 400e12, "mfu": 0.4},
            "adamw_4": {"layers": 4, "step_s": 1.6, "model_flops_per_step": 600e12, "mfu": 600e12 / 1.6 / 1e15},
            "muon_4": {"layers": 4, "step_s": 1.85, "model_flops_per_step": 600e12, "mfu": 0.3}}
    out = gpu_proxy.derived(runs)
    assert out["per_layer"]["seconds"] == pytest.approx(0.3)
    assert out["per_layer"]["model_flops"] == pytest.approx(100e12)
    assert out["per_layer"]["mfu"] == pytest.approx(100e12 / 0.3 / 1e15)
    assert out["newton_schulz_s_per_step"] == pytest.approx(0.25)
    assert gpu_proxy.derived({"adamw_2": {"error": "x"}, "adamw_4": runs["adamw_4"]}) == {
        "whole_step_mfu": {"adamw_4": runs["adamw_4"]["mfu"]}}


def test_a_section_runs_alone_and_a_hung_one_is_killed_on_time(monkeypatch, tmp_path):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    env = gpu_selftest.run_section("environment", 120)
    assert env["backend"] == "cpu" and env["versions"]["jax"] == jax.__version__ and env["seconds"] < 120
    failed = gpu_selftest.run_section("no_such_section", 60)
    assert failed["error"].startswith("exit 1:") and "unknown section 'no_such_section'" in failed["error"]
    # a section that hangs, with a child of its own (as a GPU process's compiler helpers would)
    hang = tmp_path / "hang"
    hang.write_text(f"#!/bin/sh\nsleep 300 &\necho $! > {tmp_path}/grandchild\nsleep 300\n")
    hang.chmod(0o755)
    monkeypatch.setattr(gpu_selftest.sys, "executable", str(hang))
    start = time.perf_counter()
    hung = gpu_selftest.run_section("kernels", 2)
    assert hung["error"] == "timed out after 2 s" and time.perf_counter() - start < 10
    grandchild = int((tmp_path / "grandchild").read_text())
    time.sleep(0.2)
    stat = f"/proc/{grandchild}/stat"  # the whole process group is gone (or a zombie not yet reaped)
    assert not os.path.exists(stat) or open(stat).read().rsplit(")", 1)[1].split()[0] == "Z"


def test_the_carried_wheels_and_the_image_cover_every_dependency():
    """benchmarks/gpu/carry_wheels.sh's list plus the lent image's packages hold every run-time dependency
    pyproject.toml names for Python 3.12, each carried one at its pinned version."""
    script = open(os.path.join(REPO, "benchmarks/gpu/carry_wheels.sh")).read()
    carried = dict(re.findall(r"([A-Za-z][\w.-]*)==([\w.]+)", re.search(r"CARRY=\((.*?)\)", script, re.S).group(1)))
    image = {ln.strip().lower() for ln in open(os.path.join(REPO, "benchmarks/gpu/h200_image_packages.txt"))
             if ln.strip() and not ln.startswith("#")}
    carried_lower = {name.lower(): version for name, version in carried.items()}
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        requirements = [Requirement(line) for line in tomllib.load(f)["project"]["dependencies"]]
    for r in requirements:
        if r.marker is None or r.marker.evaluate({"python_version": "3.12"}):
            name = r.name.lower()
            assert name in image or name in carried_lower, r.name
            if name in carried_lower:
                assert str(r.specifier) == f"=={carried_lower[name]}", (r, carried_lower[name])
    assert "portpicker" in carried_lower and "array-record" in carried_lower  # grain's, absent from the image


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


def test_fp8_section_measures_the_chips_formats_beside_bf16():
    """The fp8 section's function at a small size on this CPU: the formats zaya_jax.model.fp8 picks
    for the chip (OCP here), a rate for bf16, the raw FP8 dot and the training product, each
    beside bf16's."""
    from benchmarks.gpu.gpu_selftest import bench_fp8
    out = bench_fp8(64, 1)
    assert out["chip"] == "cpu" and out["formats"] == {"forward": "float8_e4m3fn", "backward": "float8_e5m2"}
    for name in ("fp8_dot", "fp8_training_product_fwd_bwd"):
        assert out[name]["tflops"] > 0 and out[name]["vs_bf16"] > 0, out
