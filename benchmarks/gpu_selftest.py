"""GPU self-test: one command, meant to finish in under 8 minutes on one H200 or MI300X.

    python -m benchmarks.gpu_selftest [--out benchmarks/results/gpu_selftest_<backend>.json]
                                      [--calibration-out benchmarks/results/gpu_calibration_<backend>.json]

Without a GPU it prints what it would run (JSON) and exits 0: nothing here has run on a GPU yet.
On a GPU, sections in order (the JSON file is rewritten after each, so a cut run keeps what it
measured; a failing section is recorded as {"error": ...} and the run goes on):
  calibration dense bf16 matmul TFLOP/s, HBM GB/s, all-reduce bus GB/s over the local GPUs
             (benchmarks/gpu_calibration.py), also written as the planner's calibration file for
             `python -m zaya_jax.plan ... --calibration benchmarks/results/gpu_calibration_rocm.json`
  kernels    every Pallas kernel compiled at the platform's blocks and checked, values and
             gradients, against its fp32 reference (benchmarks/gpu_kernels.py's checks)
  attention  CCA flash attention against XLA attention, forward and forward+backward, ZAYA1-base
             heads (8 query, 2 KV, head dim 128, bf16, causal) at batch 2 x 4096
  moe        one MoE layer forward+backward at ZAYA1-base widths (D = I = 2048, 16 experts, bf16,
             16,384 tokens, skewed routing) for: ragged with XLA's ragged_dot (default flags);
             ragged_dot with the platform's grouped-GEMM flag (a subprocess, since XLA reads its
             flags at start); ragged with the Pallas grouped matmul (the GPU default); capacity
             1.25. TFLOP/s of the top-1 expert FLOPs, beside one dense [T, D] @ [D, I] matmul
  proxy      a ZAYA1-shaped proxy training run through the Trainer itself: ZAYA1-base widths,
             vocabulary and heads with 4 layers, seq 4096, batch 2, bf16, dots_no_batch remat,
             Muon, synthetic data, 12 steps; the MFU of its last logged window (the trainer's
             model-FLOPs count over the device's bf16 peak, zaya_jax.train.metrics)
Targets (issue 12): proxy MFU >= 40% (bf16), attention forward+backward >= 1.5x XLA, grouped
matmul >= 60% of the dense matmul's TFLOP/s.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

from benchmarks import gpu_calibration, gpu_kernels  # noqa: E402
from pallas_kernels import _backend, grouped_matmul  # noqa: E402
from zaya_jax.model import moe_dispatch  # noqa: E402
from zaya_jax.model.moe_dispatch import ExpertWeights  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MOE = {"tokens": 16384, "hidden": 2048, "ffn": 2048, "experts": 16}
ATTENTION = (2, 4096)
PROXY = {"num_layers": 4, "seq_len": 4096, "global_batch_size": 2, "steps": 12, "log_every_steps": 4}
GROUPED_GEMM_FLAG = {"cuda": "--xla_gpu_experimental_use_ragged_dot_fusion=true",
                     "rocm": "--xla_gpu_experimental_use_ragged_dot_grouped_gemm=true"}
MOE_PATHS = ("ragged_dot", "ragged_dot_grouped_gemm_flag", "pallas_grouped_matmul", "capacity_1.25")
ITERS = 10


def plan() -> dict:
    """What a GPU run does, without running it."""
    return {"calibration": {"matmul": gpu_calibration.MATMUL_N, "hbm_bf16_elements": gpu_calibration.HBM_ELEMENTS,
                            "all_reduce_bf16_elements_per_device": gpu_calibration.ALL_REDUCE_ELEMENTS,
                            "writes": "benchmarks/results/gpu_calibration_<backend>.json"},
            "kernels": "cca_flash_attention fwd/dq/dkdv and gmm/gmm_transposed_rhs/tgmm vs fp32 references",
            "attention": {"batch_seq": ATTENTION, "compare": ["pallas", "xla"]},
            "moe": {**MOE, "paths": MOE_PATHS, "grouped_gemm_flag": GROUPED_GEMM_FLAG},
            "proxy": {**PROXY, "config": "configs/zaya1_base.py", "dtype": "bfloat16"}}


def moe_inputs():
    t, d, f, e = MOE["tokens"], MOE["hidden"], MOE["ffn"], MOE["experts"]
    keys = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(keys[0], (t, d), jnp.float32).astype(jnp.bfloat16)
    w = ExpertWeights(*((jax.random.normal(k, s, jnp.float32) * s[1] ** -0.5).astype(jnp.bfloat16)
                        for k, s in zip(keys[1:4], [(e, d, f), (e, d, f), (e, f, d)])))
    p = 1 / np.arange(1, e + 1) ** 1.2  # Zipf-like skew, as at random init
    expert = jnp.asarray(np.random.default_rng(0).choice(e, size=t, p=p / p.sum()), jnp.int32)
    return x, expert, w


def moe_path(name: str):
    return {"ragged_dot": moe_dispatch.ragged, "ragged_dot_grouped_gemm_flag": moe_dispatch.ragged,
            "pallas_grouped_matmul": functools.partial(moe_dispatch.ragged, matmul=grouped_matmul),
            "capacity_1.25": functools.partial(moe_dispatch.capacity, capacity_factor=1.25)}[name]


def bench_moe_path(name: str) -> dict:
    x, expert, w = moe_inputs()
    flops = 3 * 3 * 2.0 * MOE["tokens"] * MOE["hidden"] * MOE["ffn"]  # 3 matmuls, forward + backward

    def loss(x, w):
        return jnp.sum(moe_path(name)(x, expert, w)[0].astype(jnp.float32) ** 2)
    step = jax.jit(jax.grad(loss, argnums=(0, 1)))
    return gpu_kernels.measure(step, (x, w), flops, ITERS)


def bench_moe() -> dict:
    out = {}
    for name in MOE_PATHS:
        if name == "ragged_dot_grouped_gemm_flag":
            flag = GROUPED_GEMM_FLAG[_backend.target()]
            env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {flag}"}
            run = subprocess.run([sys.executable, "-m", "benchmarks.gpu_selftest", "--moe-path", name],
                                 capture_output=True, text=True, env=env, timeout=300, cwd=REPO)
            out[name] = (json.loads(run.stdout) if run.returncode == 0
                         else {"error": run.stderr[-500:]}) | {"xla_flag": flag}
        else:
            out[name] = gpu_kernels.guarded(bench_moe_path, name)
    x, _, w = moe_inputs()  # one dense [T, D] @ [D, I], forward + backward: the rate to compare with
    dense = jax.jit(jax.grad(lambda x, g: jnp.sum((x @ g).astype(jnp.float32) ** 2), argnums=(0, 1)))
    out["dense_matmul"] = gpu_kernels.measure(dense, (x, w.gate[0]), 3 * 2.0 * MOE["tokens"] * MOE["hidden"]
                                              * MOE["ffn"], ITERS)
    return out


def proxy_mfu() -> dict:
    from zaya_jax.config_files import load_config_file
    from zaya_jax.train.loop import Trainer
    config = load_config_file(os.path.join(REPO, "configs/zaya1_base.py"))
    config.model.num_layers = PROXY["num_layers"]
    config.train.update(dict(data="synthetic", seq_len=PROXY["seq_len"], global_batch_size=PROXY["global_batch_size"],
                             steps=PROXY["steps"], log_every_steps=PROXY["log_every_steps"]))
    config.optimizer.warmup_steps = 2
    config.eval.every_steps = 0
    config.checkpoint.every_steps = 0
    config.mesh.update(dict(data=-1, tensor=1))
    config.monitor.update(dict(progress_bar=False, tensorboard=False, heatmap_every_steps=0))
    records = []
    with tempfile.TemporaryDirectory() as workdir:
        trainer = Trainer(config, workdir, on_log=records.append)
        try:
            trainer.run()
        finally:
            trainer.close()
    last = [r for r in records if r["kind"] == "train"][-1]
    return {**PROXY, "mfu": last["mfu"], "tokens_per_sec": last["tokens_per_sec"], "loss": last["loss"]}


def calibrate(path: str) -> dict:
    """The measured rates, with the calibration file written to `path` from them."""
    measured = gpu_calibration.measure()
    return {**measured, "written": {"path": path, **gpu_calibration.write(measured, path)}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="default: benchmarks/results/gpu_selftest_<backend>.json")
    parser.add_argument("--calibration-out", default=None,
                        help="default: benchmarks/results/gpu_calibration_<backend>.json (plan --calibration)")
    parser.add_argument("--moe-path", choices=MOE_PATHS, help=argparse.SUPPRESS)  # one MoE timing (subprocess)
    args = parser.parse_args()
    if args.moe_path:
        print(json.dumps(bench_moe_path(args.moe_path)))
        return
    if _backend.target() not in _backend.GPU_TARGETS:
        print(json.dumps({"gpu": False, "backend": _backend.target(),
                          "message": "no GPU: nothing run; on a GPU this runs", "would_run": plan()}, indent=1))
        return
    out = args.out or f"benchmarks/results/gpu_selftest_{_backend.target()}.json"
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    start = time.perf_counter()
    result = {"jax": jax.__version__, "backend": _backend.target(), "device": jax.devices()[0].device_kind}
    calibration_out = args.calibration_out or f"benchmarks/results/gpu_calibration_{_backend.target()}.json"
    sections = {
        "calibration": lambda: calibrate(calibration_out),
        "kernels": lambda: {"attention": gpu_kernels.guarded(gpu_kernels.check_attention, 1, 1000),
                            "gmm": gpu_kernels.guarded(gpu_kernels.check_gmm, 3000, 512, 768)},
        "attention": lambda: gpu_kernels.bench_attention(*ATTENTION, ITERS, on_gpu=True),
        "moe": bench_moe,
        "proxy": proxy_mfu,
    }
    for name, run in sections.items():
        print(f"[{time.perf_counter() - start:6.1f}s] {name}", file=sys.stderr, flush=True)
        result[name] = gpu_kernels.guarded(run)
        result["wall_s"] = round(time.perf_counter() - start, 1)
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
