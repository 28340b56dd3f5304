"""The heap launch default (zaya_jax.launch_defaults: one glibc heap that keeps what it frees)
against glibc's defaults, on the bench_small train step of both zaya_jax and HF transformers +
torch AdamW. Prints JSON (benchmarks/results/allocator_cpu.json).

  python -m benchmarks.training.allocator [--rounds 3] [--steps 4]

A heap that has kept memory cannot be compared in the same process with one that has not, so
each round starts one child per setting, back to back (the order alternates between rounds),
and each child times both sides' steps alternately (benchmarks/training/train_step.py's steps), counting
page faults and kernel (sys) CPU time per step and the peak resident memory with getrusage. Both sides get the same setting
in a child, so `speedup_vs_hf` compares like with like. Compiled programs are shared through a
temporary JAX compilation cache, so only the first child compiles.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile

from benchmarks.common import REPO  # noqa: E402
from zaya_jax import launch_defaults  # noqa: E402

SETTINGS = {"glibc_default": {"ZAYA_NO_LAUNCH_DEFAULTS": "1"}, "launch_defaults": {}}


def measured(fn) -> tuple[float, int, float]:
    """Runs fn (blocking) -> (wall s, minor page faults, sys CPU s) of that call."""
    import time
    before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    fn()
    wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF)
    return wall, after.ru_minflt - before.ru_minflt, after.ru_stime - before.ru_stime


def child(steps: int) -> dict:
    applied = launch_defaults.apply()  # before jax and torch allocate anything
    from benchmarks.training.train_step import hf_and_jax_steps
    jax_step, torch_step, _ = hf_and_jax_steps()
    jax_step(), torch_step()  # compile / warm up
    rows = {"zaya_jax": [], "hf_torch": []}
    for _ in range(steps):
        rows["zaya_jax"].append(measured(jax_step))
        rows["hf_torch"].append(measured(torch_step))
    out = {}
    for side, r in rows.items():
        out[side] = {"s_per_step": statistics.median(x[0] for x in r),
                     "page_faults_per_step": statistics.median(x[1] for x in r),
                     "sys_cpu_s_per_step": statistics.median(x[2] for x in r)}
    out["applied"] = applied
    out["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.steps)))
        return
    load_start = os.getloadavg()[0]
    runs = {name: [] for name in SETTINGS}
    with tempfile.TemporaryDirectory() as cache:
        base = {k: v for k, v in os.environ.items()
                if k not in ("GLIBC_TUNABLES", "ZAYA_NO_LAUNCH_DEFAULTS") and not k.startswith("MALLOC_")}
        base.update(JAX_COMPILATION_CACHE_DIR=cache, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                    PYTHONPATH=REPO)
        for r in range(args.rounds):
            for name in (list(SETTINGS) if r % 2 == 0 else list(SETTINGS)[::-1]):
                done = subprocess.run([sys.executable, "-m", "benchmarks.training.allocator", "--child", "--steps", str(args.steps)],
                                      env={**base, **SETTINGS[name]}, capture_output=True, text=True, check=True)
                runs[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
    summary = {}
    for name, rs in runs.items():
        summary[name] = {side: {key: round(statistics.median(r[side][key] for r in rs), 4)
                                for key in rs[0][side]} for side in ("zaya_jax", "hf_torch")}
        summary[name]["applied"] = [r["applied"] for r in rs]
        summary[name]["peak_rss_gib"] = round(max(r["peak_rss_gib"] for r in rs), 2)
        summary[name]["speedup_vs_hf"] = round(statistics.median(
            r["hf_torch"]["s_per_step"] / r["zaya_jax"]["s_per_step"] for r in rs), 3)
    pairs = list(zip(runs["glibc_default"], runs["launch_defaults"]))
    print(json.dumps({
        "config": "bench_small", "heap_settings": "glibc mallopt: arena_max 1, mmap_max 0, trim_threshold 2 GiB", "rounds": args.rounds,
        "steps_per_child": args.steps, "settings": summary,
        "zaya_jax_step_speedup_launch_defaults_vs_glibc_default": round(statistics.median(
            d["zaya_jax"]["s_per_step"] / h["zaya_jax"]["s_per_step"] for d, h in pairs), 3),
        "hf_torch_step_speedup_launch_defaults_vs_glibc_default": round(statistics.median(
            d["hf_torch"]["s_per_step"] / h["hf_torch"]["s_per_step"] for d, h in pairs), 3),
        "cpu_count": os.cpu_count(), "machine": "shared with other jobs: see the load average",
        "load_average_1min_start_end": [round(load_start, 2), round(os.getloadavg()[0], 2)],
    }, indent=2))


if __name__ == "__main__":
    main()
