"""GPU self-test: one command, at most 9 minutes on one H200 or MI300X, that cannot waste its shot.

    python -m benchmarks.gpu.gpu_selftest [--out FILE] [--calibration-out FILE] [--budget-s 540]

On a machine lent for minutes whose image lacks packages (the lent H200's): `bash
benchmarks/gpu/carry_wheels.sh` here puts them in .carry/wheels; there, with .carry carried along:

    pip install -q --no-index --no-deps --target .carry/site .carry/wheels/*.whl && \
      PYTHONPATH=.carry/site python3 -m benchmarks.gpu.gpu_selftest

This process never touches
the GPU: it checks the imports first (what is missing, and against the pins, is printed and
recorded), then runs each section in a subprocess of its own, with its own timeout, alone on the
GPU (XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 each), so a hung kernel or a sticky device error ends one
section only. The results file (default benchmarks/results/gpu_selftest_<backend>.json) is
rewritten after every section; a section that would not fit in what is left of the budget is
recorded as skipped. Without a GPU it prints what it would run (JSON), writes nothing, exits 0.

Sections, most valuable first (seconds: each one's timeout):
  environment   python, jax, jaxlib and plugin versions, driver, cuDNN or ROCm, XLA_FLAGS, devices 30
  proxy_*       benchmarks/gpu/gpu_proxy.py at ZAYA1-base widths: AdamW at 2 and 4 layers, Muon at 4 100 each
                -> per-layer MFU by differencing the depths, Newton-Schulz time, whole-step MFU
  calibration   dense bf16 matmul, HBM, intra-node all-reduce rates, written as the planner's
                calibration file (default benchmarks/results/gpu_calibration_<backend>.json)     30
  kernels       every Pallas kernel against its fp32 reference, values and gradients             45
  attention     CCA flash attention against XLA and cuDNN, forward and forward+backward,
                ZAYA1-base heads at batch 2 x 4096                                               45
  moe           one MoE layer forward+backward at ZAYA1-base widths (16,384 tokens, skewed
                routing): XLA ragged_dot, the Pallas grouped matmul, capacity 1.25, beside one
                dense [T, D] @ [D, I] matmul                                                     45
  fp8           the chip's FP8 matmul rate (zaya_jax.model.fp8's formats for it: OCP on H100/H200,
                FNUZ on MI300X) beside bf16's at 8192^3, the raw e4m3 dot and the training
                product (quantize, dot, scale) forward+backward, and the ratios to bf16: what
                the planner assumes (fp8_matmul_tflops = 2x bf16 at the same efficiency) 15
  moe_grouped_gemm_flag  XLA's ragged_dot with the platform's grouped-GEMM flag (XLA reads flags
                at start: a process of its own)                                                  30
Timings (benchmarks.common.device_time): batches of back-to-back calls, one sync per batch, each
figure with the launch overhead's share of a call. Targets: per-layer proxy MFU >= 40% (bf16),
attention and expert matmuls forward+backward >= 60% of the measured matmul rate.
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
import tomllib

from benchmarks.common import REPO  # noqa: E402
MOE = {"tokens": 16384, "hidden": 2048, "ffn": 2048, "experts": 16}
ATTENTION = (2, 4096)
GROUPED_GEMM_FLAG = {"cuda": "--xla_gpu_experimental_use_ragged_dot_fusion=true",
                     "rocm": "--xla_gpu_experimental_use_ragged_dot_grouped_gemm=true"}
MOE_PATHS = ("ragged_dot", "pallas_grouped_matmul", "capacity_1.25")
REPEATS = 5
GPU_BACKENDS = ("cuda", "rocm")
RESULT_LINE = "SECTION_RESULT "
# Distribution name -> module, where they differ (the preflight's import check).
MODULES = {"absl-py": "absl", "ml-collections": "ml_collections", "orbax-checkpoint": "orbax.checkpoint",
           "scipy-openblas32": "scipy_openblas32", "array-record": "array_record", "pyyaml": "yaml",
           "pillow": "PIL"}


def sections() -> dict[str, int]:
    """Section -> timeout in seconds, in the order they run."""
    from benchmarks.gpu.gpu_proxy import RUNS
    return {"environment": 30, **{f"proxy_{o}_{n}": 100 for o, n in RUNS}, "calibration": 30,
            "kernels": 45, "attention": 45, "moe": 45, "fp8": 15,
            "moe_grouped_gemm_flag": 30}


# -- the parent: preflight, one subprocess per section ------------------------------------------

def pinned_requirements() -> list[tuple[str, str | None]]:
    """(distribution, pinned version or None) of every run-time dependency for this Python."""
    from packaging.requirements import Requirement
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        lines = tomllib.load(f)["project"]["dependencies"]
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    out = []
    for r in map(Requirement, lines):
        if r.marker is None or r.marker.evaluate({"python_version": python}):
            exact = [s.version for s in r.specifier if s.operator == "=="]
            out.append((r.name, exact[0] if exact else None))
    return out


def preflight() -> dict:
    """{"missing": [distributions not importable], "other_versions": {dist: [installed, pinned]}}."""
    missing, other = [], {}
    for dist, pinned in pinned_requirements():
        module = MODULES.get(dist.lower(), dist.replace("-", "_"))
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:  # a dotted module whose parent package is absent
            found = False
        if not found:
            missing.append(dist)
            continue
        try:
            installed = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:  # importable from a folder on PYTHONPATH
            continue
        if pinned and installed != pinned:
            other[dist] = [installed, pinned]
    return {"missing": missing, "other_versions": other}


def run_section(name: str, timeout_s: float, extra_env: dict[str, str] | None = None) -> dict:
    """The section's JSON from a subprocess of its own (its whole process group killed past `timeout_s`)."""
    env = {**os.environ, "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.9", **(extra_env or {})}
    start = time.perf_counter()
    child = subprocess.Popen([sys.executable, "-m", "benchmarks.gpu.gpu_selftest", "--section", name], cwd=REPO,
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
    try:
        stdout, stderr = child.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        child.communicate()
        return {"error": f"timed out after {timeout_s:.0f} s", "seconds": round(time.perf_counter() - start, 1)}
    lines = [ln for ln in stdout.splitlines() if ln.startswith(RESULT_LINE)]
    if child.returncode != 0 or not lines:
        return {"error": f"exit {child.returncode}: {stderr.strip()[-800:]}",
                "seconds": round(time.perf_counter() - start, 1)}
    return {**json.loads(lines[-1][len(RESULT_LINE):]), "seconds": round(time.perf_counter() - start, 1)}


def plan() -> dict:
    """What a GPU run does, without running it."""
    from benchmarks.gpu import gpu_calibration, gpu_proxy
    return {"sections": sections(),
            "calibration": {"matmul": gpu_calibration.MATMUL_N, "hbm_bf16_elements": gpu_calibration.HBM_ELEMENTS,
                            "all_reduce_bf16_elements_per_device": gpu_calibration.ALL_REDUCE_ELEMENTS,
                            "writes": "benchmarks/results/gpu_calibration_<backend>.json"},
            "kernels": "cca_flash_attention fwd/dq/dkdv and gmm/gmm_transposed_rhs/tgmm vs fp32 references",
            "attention": {"batch_seq": ATTENTION, "compare": ["pallas", "xla", "cudnn (cuda)"]},
            "moe": {**MOE, "paths": MOE_PATHS, "grouped_gemm_flag": GROUPED_GEMM_FLAG},
            "proxy": {"runs": [f"{o}_{n}" for o, n in gpu_proxy.RUNS], "seq_len": gpu_proxy.SEQ_LEN,
                      "sequences_per_device": gpu_proxy.SEQUENCES_PER_DEVICE, "steps": gpu_proxy.STEPS,
                      "config": "configs/zaya1_base.py", "dtype": "bfloat16"}}


def main_parent(args) -> None:
    start = time.perf_counter()
    checked = preflight()
    if checked["missing"]:
        print(f"missing packages: {', '.join(checked['missing'])} (sections that import them will fail; "
              "benchmarks/gpu/carry_wheels.sh prepares them)", file=sys.stderr, flush=True)
    timeouts = sections()
    environment = run_section("environment", timeouts.pop("environment"))
    if environment.get("backend") not in GPU_BACKENDS:
        print(json.dumps({"gpu": False, "backend": environment.get("backend"), "environment": environment,
                          "preflight": checked, "message": "no GPU: nothing run; on a GPU this runs",
                          "would_run": plan()}, indent=1))
        return
    backend = environment["backend"]
    out = args.out or os.path.join(REPO, f"benchmarks/results/gpu_selftest_{backend}.json")
    calibration_out = args.calibration_out or os.path.join(REPO, f"benchmarks/results/gpu_calibration_{backend}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    result = {"preflight": checked, "environment": environment, "budget_s": args.budget_s}
    for name, timeout_s in timeouts.items():
        left = args.budget_s - (time.perf_counter() - start)
        print(f"[{time.perf_counter() - start:6.1f}s] {name}", file=sys.stderr, flush=True)
        if left < timeout_s:
            result[name] = {"skipped": f"{left:.0f} s of the budget left, the section may take {timeout_s} s"}
        else:
            extra = {"ZAYA_CALIBRATION_OUT": calibration_out} if name == "calibration" else {}
            if name == "moe_grouped_gemm_flag":
                extra["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {GROUPED_GEMM_FLAG[backend]}"
            result[name] = run_section(name, timeout_s, extra)
        if name.startswith("proxy_"):
            from benchmarks.gpu.gpu_proxy import derived
            result["proxy"] = derived({k[len("proxy_"):]: v for k, v in result.items() if k.startswith("proxy_")})
        result["wall_s"] = round(time.perf_counter() - start, 1)
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))


# -- a section, in its own process -------------------------------------------------------------

def environment() -> dict:
    import jax

    from pallas_kernels import _backend
    out = {"python": sys.version.split()[0], "backend": _backend.target(), "xla_flags": os.environ.get("XLA_FLAGS", ""),
           "devices": [d.device_kind for d in jax.devices()]}
    out["versions"] = {d: _version(d) for d in ("jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda13-plugin",
                                                  "jax-rocm7-plugin", "nvidia-cudnn-cu12", "nvidia-cudnn-cu13")}
    out["cudnn"] = _cudnn_version() if out["backend"] == "cuda" else None
    out["rocm"] = _rocm_version() if out["backend"] == "rocm" else None
    out["driver"] = _driver(out["backend"])
    return out


def _rocm_version() -> str | None:
    """The node's ROCm release, as its install records it."""
    path = os.path.join(os.environ.get("ROCM_PATH", "/opt/rocm"), ".info", "version")
    return open(path).read().strip() if os.path.isfile(path) else None


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cudnn_version() -> int | str | None:
    try:
        from jax._src.lib import cuda_versions
        return cuda_versions.cudnn_get_version() if cuda_versions else None
    except Exception as e:  # noqa: BLE001  (a private jax module: its absence must not cost the section)
        return f"unknown ({type(e).__name__})"


def _driver(backend: str) -> str | None:
    command = {"cuda": ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
               "rocm": ["rocm-smi", "--showdriverversion"]}.get(backend)
    if command is None:
        return None
    try:
        text = subprocess.run(command, capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unknown ({type(e).__name__})"
    found = re.search(r"\d+\.\d+(\.\d+)*", text)
    return found.group(0) if found else text.strip()[:80] or None


def moe_inputs():
    import jax
    import jax.numpy as jnp
    import numpy as np

    from zaya_jax.model.moe_dispatch import ExpertWeights
    t, d, f, e = MOE["tokens"], MOE["hidden"], MOE["ffn"], MOE["experts"]
    keys = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(keys[0], (t, d), jnp.float32).astype(jnp.bfloat16)
    w = ExpertWeights(*((jax.random.normal(k, s, jnp.float32) * s[1] ** -0.5).astype(jnp.bfloat16)
                        for k, s in zip(keys[1:4], [(e, d, f), (e, d, f), (e, f, d)])))
    p = 1 / np.arange(1, e + 1) ** 1.2  # Zipf-like skew, as at random init
    expert = jnp.asarray(np.random.default_rng(0).choice(e, size=t, p=p / p.sum()), jnp.int32)
    return x, expert, w


def bench_moe_path(name: str) -> dict:
    import jax
    import jax.numpy as jnp

    from benchmarks.gpu import gpu_kernels
    from pallas_kernels import grouped_matmul, grouped_matmuls
    from zaya_jax.model import moe_dispatch
    dispatch = {"ragged_dot": moe_dispatch.ragged,
                "pallas_grouped_matmul": functools.partial(moe_dispatch.ragged, matmul=grouped_matmul,
                                                           matmuls=grouped_matmuls),
                "capacity_1.25": functools.partial(moe_dispatch.capacity, capacity_factor=1.25)}[name]
    x, expert, w = moe_inputs()
    flops = 3 * 3 * 2.0 * MOE["tokens"] * MOE["hidden"] * MOE["ffn"]  # 3 matmuls, forward + backward

    def loss(x, w):
        return jnp.sum(dispatch(x, expert, w)[0].astype(jnp.float32) ** 2)
    return gpu_kernels.measure(jax.jit(jax.grad(loss, argnums=(0, 1))), (x, w), flops, REPEATS)


def bench_moe() -> dict:
    import jax
    import jax.numpy as jnp

    from benchmarks.gpu import gpu_kernels
    out = {name: gpu_kernels.guarded(bench_moe_path, name) for name in MOE_PATHS}
    x, _, w = moe_inputs()  # one dense [T, D] @ [D, I], forward + backward: the rate to compare with
    dense = jax.jit(jax.grad(lambda x, g: jnp.sum((x @ g).astype(jnp.float32) ** 2), argnums=(0, 1)))
    out["dense_matmul"] = gpu_kernels.measure(dense, (x, w.gate[0]), 3 * 2.0 * MOE["tokens"] * MOE["hidden"]
                                              * MOE["ffn"], REPEATS)
    return out


def bench_fp8(n: int, repeats: int) -> dict:
    """The FP8 matmul rate of the chip built for at [n, n] @ [n, n] beside bf16's: the raw dot
    (e4m3 operands, f32 accumulation) and zaya_jax.model.fp8's training product forward+backward
    (3 dots: forward e4m3, both gradients e5m2 x e4m3), TFLOP/s each and as multiples of bf16's."""
    import jax
    import jax.numpy as jnp

    from benchmarks.gpu import gpu_kernels
    from zaya_jax.model import fp8
    chip = fp8.chip()
    fmt = fp8.formats("fp8", chip)
    a = jnp.ones((n, n), jnp.bfloat16)
    a8 = a.astype(fmt.forward)
    flops = 2.0 * n**3
    product = jax.grad(lambda x, w: jnp.sum(fp8.einsum("ik,kj->ij", x, w, fmt=fmt)), argnums=(0, 1))
    out = {"chip": chip, "formats": fmt._asdict(), "n": n,
           "bf16": gpu_kernels.measure(jax.jit(jnp.matmul), (a, a), flops, repeats),
           "fp8_dot": gpu_kernels.measure(
               jax.jit(lambda x, y: jnp.matmul(x, y, preferred_element_type=jnp.float32)), (a8, a8), flops, repeats),
           "fp8_training_product_fwd_bwd": gpu_kernels.measure(jax.jit(product), (a, a), 3 * flops, repeats)}
    for name in ("fp8_dot", "fp8_training_product_fwd_bwd"):
        if "tflops" in out[name] and "tflops" in out["bf16"]:
            out[name]["vs_bf16"] = out[name]["tflops"] / out["bf16"]["tflops"]
    return out


def calibrate() -> dict:
    """The measured rates, with the planner's calibration file written from them."""
    from benchmarks.gpu import gpu_calibration
    measured = gpu_calibration.measure()
    path = os.environ["ZAYA_CALIBRATION_OUT"]
    return {**measured, "written": {"path": path, **gpu_calibration.write(measured, path)}}


def section(name: str) -> dict:
    from benchmarks.gpu import gpu_kernels
    if name == "environment":
        return environment()
    if name.startswith("proxy_"):
        from benchmarks.gpu import gpu_proxy
        optimizer, layers = name[len("proxy_"):].rsplit("_", 1)
        return gpu_proxy.run(int(layers), optimizer)
    if name == "calibration":
        return calibrate()
    if name == "kernels":
        return {"attention": gpu_kernels.guarded(gpu_kernels.check_attention, 1, 1000),
                "gmm": gpu_kernels.guarded(gpu_kernels.check_gmm, 3000, 512, 768)}
    if name == "attention":
        return gpu_kernels.bench_attention(*ATTENTION, REPEATS, on_gpu=True)
    if name == "moe":
        return bench_moe()
    if name == "fp8":
        from benchmarks.gpu import gpu_calibration
        return bench_fp8(gpu_calibration.MATMUL_N, REPEATS)
    if name == "moe_grouped_gemm_flag":
        return {**bench_moe_path("ragged_dot"), "xla_flags": os.environ.get("XLA_FLAGS", "")}
    raise ValueError(f"unknown section {name!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="default: benchmarks/results/gpu_selftest_<backend>.json")
    parser.add_argument("--calibration-out", default=None,
                        help="default: benchmarks/results/gpu_calibration_<backend>.json (plan --calibration)")
    parser.add_argument("--budget-s", type=float, default=540, help="the whole run's time budget, seconds")
    parser.add_argument("--section", help=argparse.SUPPRESS)  # one section, in a process of its own
    args = parser.parse_args()
    if args.section:
        print(RESULT_LINE + json.dumps(section(args.section)), flush=True)
        return
    main_parent(args)


if __name__ == "__main__":
    main()
