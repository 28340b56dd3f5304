"""Shared timing helper for benchmark scripts (which print JSON; they are never tests)."""

from __future__ import annotations

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
