"""Shared timing helpers for benchmark scripts (which print JSON; they are never tests)."""

from __future__ import annotations

import json
import os
import statistics
import time
from typing import Callable


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
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", filename), "w") as f:
        f.write(text + "\n")
