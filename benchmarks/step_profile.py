"""Where one real train step spends its time, per block: runs the Trainer (configs/bench_small.py
by default) with its profiler on, then sums the traced ops' durations by the block scope in
their HLO op names (zaya_jax.train.profiling.block_of). Prints JSON.

  python benchmarks/step_profile.py [--config configs/bench_small.py] [--warmup 3] [--steps 3]

Unlike benchmarks/train_step.py's breakdown (each part compiled and timed on its own), this
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
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

from zaya_jax.config_files import load_config_file  # noqa: E402
from zaya_jax.train.loop import Trainer  # noqa: E402
from zaya_jax.train.profiling import block_of  # noqa: E402

CONTROL_FLOW = ("while", "conditional", "call")


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
    parser.add_argument("--config", default=os.path.join(os.path.dirname(__file__), "..", "configs", "bench_small.py"))
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
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
    per_block = collections.Counter()
    steps = [e for e in events if e.get("name", "").startswith("PjitFunction(run_train_step)")]
    for e in events:
        opcode, op_name = ops.get(e.get("name", ""), (None, ""))
        if opcode is not None and opcode not in CONTROL_FLOW:
            per_block[block_of(op_name)] += e["dur"] / 1e3 / args.steps  # us -> ms per step
    total = sum(per_block.values())
    print(json.dumps({
        "config": os.path.basename(args.config), "platform": jax.default_backend(),
        "moe_backend": trainer.settings.model.moe_backend, "traced_steps": args.steps,
        "run_s_including_compile": round(run_s, 1), "step_dispatch_events": len(steps),
        "op_ms_per_step": {k: round(v, 1) for k, v in per_block.most_common()},
        "share": {k: round(v / total, 3) for k, v in per_block.most_common()},
    }, indent=2))


if __name__ == "__main__":
    main()
