"""Shared timing helpers for benchmark scripts (which print JSON; they are never tests)."""

from __future__ import annotations

import functools
import json
import os
import platform
import statistics
import time
from typing import Callable

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout's root
RESULTS = os.path.join(REPO, "benchmarks", "results")  # where every script's results file lives


def stack() -> dict:
    """The Python and jax a result was measured with: the demos' corpus (and so their figures)
    differs between the two stacks the project supports (its code source is that Python's
    standard library)."""
    import jax
    return {"python": platform.python_version(), "jax": jax.__version__}


def stack_suffix() -> str:
    """'py311' or 'py312': the suffix of a results file measured on this interpreter's stack."""
    major, minor = platform.python_version_tuple()[:2]
    return f"py{major}{minor}"


def wall_time(fn: Callable[[], object]) -> float:
    """Seconds of one call of `fn` (fn must block)."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def median_time(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    """Median wall time of `fn()` over `repeats` runs after `warmup` runs (fn must block)."""
    for _ in range(warmup):
        fn()
    return statistics.median(wall_time(fn) for _ in range(repeats))


def device_time(fn: Callable, args: tuple, repeats: int = 5, target_s: float = 0.2) -> dict:
    """Seconds per call of the jitted `fn(*args)` on an accelerator, timed as back-to-back calls.

    One sync per batch of calls (jax dispatches asynchronously), enough calls per batch to fill
    `target_s`, median over `repeats` batches after a compiling call, so neither the launch of one
    call nor the host's sync dominates. `launch_overhead_share`: the per-call cost of a trivial
    jitted op timed the same way, over the call's (kept below 5% by choosing large enough shapes).
    -> {"seconds", "calls_per_sync", "launch_overhead_share"}
    """
    seconds, calls = _per_call_seconds(fn, args, repeats, target_s)
    return {"seconds": seconds, "calls_per_sync": calls, "launch_overhead_share": _launch_seconds() / seconds}


def _per_call_seconds(fn: Callable, args: tuple, repeats: int, target_s: float) -> tuple[float, int]:
    import jax

    jax.block_until_ready(fn(*args))
    single = wall_time(lambda: jax.block_until_ready(fn(*args)))
    calls = max(1, min(10_000, int(target_s / max(single, 1e-6))))

    def batch():
        out = None
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
    return statistics.median(wall_time(batch) for _ in range(repeats)) / calls, calls


@functools.cache
def _launch_seconds() -> float:
    """Per-call seconds of a trivial jitted op dispatched back to back (the launch cost)."""
    import jax
    import jax.numpy as jnp
    return _per_call_seconds(jax.jit(lambda x: x + 1), (jnp.zeros((), jnp.float32),), 5, 0.2)[0]


def alternate_times(fn_a: Callable[[], object], fn_b: Callable[[], object], repeats: int
                    ) -> tuple[list[float], list[float]]:
    """Wall times of `fn_a` and `fn_b` (both must block), timed alternately after one warm-up
    each, so both see the same machine state."""
    fn_a(), fn_b()
    a: list[float] = []
    b: list[float] = []
    for _ in range(repeats):
        a.append(wall_time(fn_a))
        b.append(wall_time(fn_b))
    return a, b


def alternate_medians(fn_a: Callable[[], object], fn_b: Callable[[], object], repeats: int) -> tuple[float, float]:
    """Median wall times of `fn_a` and `fn_b`, timed alternately (`alternate_times`)."""
    a, b = alternate_times(fn_a, fn_b, repeats)
    return statistics.median(a), statistics.median(b)


def matmul_peak_gflops(sizes: tuple[int, ...] = (512, 1024, 2048), repeats: int = 10) -> float:
    """This machine's float32 matmul peak as XLA reaches it on all its cores: GFLOP/s of the fastest
    of `repeats` jitted [n, n] x [n, n] dots, over the sizes n (the rate peaks at a size that fits
    the caches; on the project's 2-core CPU near 1024, at its cores' FMA peak)."""
    import jax
    import jax.numpy as jnp
    dot = jax.jit(jnp.matmul)
    best = 0.0
    for n in sizes:
        a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
        run = lambda: dot(a, a).block_until_ready()  # noqa: E731
        run()
        best = max(best, 2 * n ** 3 / min(wall_time(run) for _ in range(repeats)) / 1e9)
    return best


def print_and_save(result: dict, filename: str) -> None:
    """Prints `result` as JSON and writes it to benchmarks/results/<filename>."""
    text = json.dumps(result, indent=2)
    print(text)
    with open(os.path.join(RESULTS, filename), "w") as f:
        f.write(text + "\n")
