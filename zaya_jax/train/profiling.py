"""A jax.profiler trace of a few training steps, written to WORKDIR/profile.

`monitor.profile_start_step = N` (0: off) traces steps N+1 .. N+`monitor.profile_steps`: the
trace starts after step N returns (compilation and warm-up are over) and stops once the last
traced step's results are ready. The directory holds, per process, an XPlane file for
TensorBoard's profile plugin / xprof and a Perfetto trace (`perfetto_trace.json.gz`, opens in
ui.perfetto.dev). Ops carry the model's scopes in their names (BLOCK_SCOPES), so time can be
summed per block (`block_of`; benchmarks/training/step_profile.py does it). On CPU, XLA records
each op only with XLA_FLAGS=--xla_cpu_enable_xprof_traceme=true (set before the run starts).
"""

from __future__ import annotations

import os
import re

import jax

# The op-name scopes the model and the step open, most specific first.
BLOCK_SCOPES = ("optimizer", "balancing", "loss_head", "moe/experts", "moe/router", "moe", "attention")


def block_of(op_name: str) -> str:
    """An op's HLO op_name (e.g. 'jit(run_train_step)/.../transpose(jvp(moe))/experts/dot_general')
    -> the first of BLOCK_SCOPES it lies in, or 'other'. Transformations wrap scopes in the
    name ('jvp(moe)/experts'); they are read through."""
    path = "/" + re.sub(r"[\w.]+\(", "", op_name).replace(")", "") + "/"
    return next((scope for scope in BLOCK_SCOPES if f"/{scope}/" in path), "other")


class StepProfiler:
    def __init__(self, directory: str, start_step: int, num_steps: int):
        self.directory, self.start_step, self.num_steps = directory, start_step, num_steps
        self.active = False

    def after_step(self, step: int, outputs) -> str | None:
        """Call after each step with its outputs -> the trace directory when a trace was written."""
        if not self.start_step:
            return None
        if step == self.start_step and not self.active:
            jax.block_until_ready(outputs)  # steps before the window do not leak into it
            os.makedirs(self.directory, exist_ok=True)
            jax.profiler.start_trace(self.directory, create_perfetto_trace=True)
            self.active = True
        elif self.active and step >= self.start_step + self.num_steps:
            return self.stop(outputs)
        return None

    def stop(self, outputs=None) -> str | None:
        """Ends a trace in progress (also at the end of a run cut short) -> its directory."""
        if not self.active:
            return None
        jax.block_until_ready(outputs)
        jax.profiler.stop_trace()
        self.active = False
        return self.directory
