"""Where one real train step spends its time: runs the Trainer (configs/bench_small.py by default)
with its profiler on, then reads the trace twice. Prints JSON.

  per block: the traced ops' durations summed by the block scope in their HLO op names
      (zaya_jax.train.profiling.block_of)
  per kind of work (`kind_of`): matmuls (XLA's dots, which XLA:CPU hands to YNNPACK, and the
      native grouped matmul of the MoE experts), slices of the stacked layer weights (`unstack`),
      copies and layout transposes, and the rest (elementwise, reductions, gathers: fusions)
  wall against busy: per traced step, the wall time from the first op's start to the last op's
      end, the time at least one thread runs an op (the union of the op intervals) and the idle
      rest (the thunk executor's scheduling between ops, waits, the host between steps)

  python -m benchmarks.training.step_profile [--config configs/bench_small.py] [--warmup 3] [--steps 3]

Unlike benchmarks/training/train_step.py's breakdown (each part compiled and timed on its own), this
attributes the step as compiled whole. Op times are summed over threads: when XLA runs
independent ops at once the sum exceeds the wall time, so compare the shares, not the sum
with the step time. Control-flow ops (while, conditional, call) are left out: their children
are counted.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import glob
import gzip
import json
import os
import re
import sys
import tempfile
import time

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_enable_xprof_traceme=true").strip()

if __name__ == "__main__":  # as the train CLI starts
    from zaya_jax import launch_defaults
    launch_defaults.apply()

import jax  # noqa: E402

from benchmarks.common import REPO  # noqa: E402
from zaya_jax.config_files import load_config_file  # noqa: E402
from zaya_jax.train.loop import Trainer  # noqa: E402
from zaya_jax.train.profiling import block_of  # noqa: E402

CONTROL_FLOW = ("while", "conditional", "call")


def kind_of(name: str, opcode: str, op_name: str) -> str:
    """A traced op (HLO instruction name, opcode, op_name metadata) -> the kind of work it does."""
    if opcode == "dot" or name.startswith("ynn_fusion"):
        return "matmul_xla"
    if opcode == "custom-call" and name.startswith("ffi_call"):
        return "matmul_native_grouped"
    if op_name.endswith("/unstack") and "slice" in name:
        return "stacked_weight_slices"
    if opcode in ("copy", "transpose") or "copy" in name or "transpose" in name:
        return "copies_and_transposes"
    return "elementwise_reduce_other"


def union_us(intervals: list[tuple[float, float]]) -> float:
    """Microseconds covered by at least one of the (start, end) intervals."""
    covered, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            covered += b - max(a, end)
            end = b
    return covered


def hlo_ops(hlo_text: str) -> dict[str, tuple[str, str]]:
    """Compiled HLO text -> {instruction name: (opcode, op_name metadata)}."""
    ops = {}
    for line in hlo_text.splitlines():
        m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = \S+ (\w[\w\-]*)\(", line)
        if m:
            op_name = re.search(r'op_name="([^"]*)"', line)
            ops[m.group(1)] = (m.group(2), op_name.group(1) if op_name else "")
    return ops


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default=os.path.join(REPO, "configs", "bench_small.py"))
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    load_start = os.getloadavg()[0]  # the CPU is shared: other jobs stretch op times and gaps
    config = load_config_file(args.config)
    config.train.update(steps=args.warmup + args.steps, log_every_steps=args.warmup + args.steps)
    config.optimizer.warmup_steps = 1
    config.eval.every_steps = 0
    config.checkpoint.every_steps = 0
    config.monitor.update(progress_bar=False, tensorboard=False, heatmap_every_steps=0,
                          profile_start_step=args.warmup, profile_steps=args.steps)
    # the Trainer's log lines go to stderr: stdout is the JSON alone
    with tempfile.TemporaryDirectory() as workdir, contextlib.redirect_stdout(sys.stderr):
        trainer = Trainer(config, workdir)
        try:
            start = time.perf_counter()
            trainer.run()
            run_s = time.perf_counter() - start
            ops = hlo_ops(trainer.compiled_step_text())
        finally:
            trainer.close()
        trace, = glob.glob(os.path.join(workdir, "profile", "plugins", "profile", "*", "perfetto_trace.json.gz"))
        with gzip.open(trace) as f:
            events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    per_block, per_kind, counts = collections.Counter(), collections.Counter(), collections.Counter()
    steps = [e for e in events if e.get("name", "").startswith("PjitFunction(run_train_step)")]
    traced = []
    for e in events:
        opcode, op_name = ops.get(e.get("name", ""), (None, ""))
        if opcode is not None and opcode not in CONTROL_FLOW:
            traced.append((e["ts"], e["ts"] + e["dur"]))
            per_block[block_of(op_name)] += e["dur"] / 1e3 / args.steps  # us -> ms per step
            kind = kind_of(e["name"], opcode, op_name)
            per_kind[kind] += e["dur"] / 1e3 / args.steps
            counts[kind] += 1 / args.steps
    total = sum(per_block.values())
    wall_ms = (max(b for _, b in traced) - min(a for a, _ in traced)) / 1e3 / args.steps
    busy_ms = union_us(traced) / 1e3 / args.steps
    print(json.dumps({
        "config": os.path.basename(args.config), "platform": jax.default_backend(),
        "moe_backend": trainer.settings.model.moe_backend, "traced_steps": args.steps,
        "run_s_including_compile": round(run_s, 1), "step_dispatch_events": len(steps),
        "op_ms_per_step": {k: round(v, 1) for k, v in per_block.most_common()},
        "share": {k: round(v / total, 3) for k, v in per_block.most_common()},
        "op_ms_per_step_by_kind": {k: round(v, 1) for k, v in per_kind.most_common()},
        "ops_per_step_by_kind": {k: round(v) for k, v in counts.most_common()},
        "share_by_kind": {k: round(v / total, 3) for k, v in per_kind.most_common()},
        "wall_ms_per_step": round(wall_ms, 1),
        "busy_ms_per_step": round(busy_ms, 1),  # at least one thread in an op
        "idle_ms_per_step": round(wall_ms - busy_ms, 1),
        "op_ms_summed_over_threads_per_step": round(total, 1),
        "cpu_count": os.cpu_count(),
        "load_average_1min_start_end": [round(load_start, 2), round(os.getloadavg()[0], 2)],
    }, indent=2))


if __name__ == "__main__":
    main()
