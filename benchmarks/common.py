"""Shared timing helper for benchmark scripts (which print JSON; they are never tests)."""

from __future__ import annotations

import statistics
import time
from typing import Callable


def best_time(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    """Median wall time of `fn()` over `repeats` runs after `warmup` runs (fn must block)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def alternate_medians(fn_a: Callable[[], object], fn_b: Callable[[], object], repeats: int) -> tuple[float, float]:
    """Median wall times of `fn_a` and `fn_b` (both must block), timed alternately after one
    warm-up each, so both see the same machine state."""
    fn_a(), fn_b()
    a: list[float] = []
    b: list[float] = []
    for _ in range(repeats):
        a.append(best_time(fn_a, 1, warmup=0))
        b.append(best_time(fn_b, 1, warmup=0))
    return statistics.median(a), statistics.median(b)
