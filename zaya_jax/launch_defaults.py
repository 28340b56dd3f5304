"""Process settings an entry point starts with (`apply()`, first thing, before jax is imported).

The heap keeps what it frees. XLA:CPU frees and reallocates its large buffers (the stacked layer
weights' gradients, optimizer temporaries: tens of MB each) on every step. By default glibc
serves blocks above its mmap threshold with fresh mappings and unmaps them on free, and trims the
heap top, so every 4 KiB page of them is faulted in and zeroed again on the next step: on
bench_small ~200k page faults and ~0.35 s of kernel time per train step
(benchmarks/results/allocator_cpu.json). `apply()` tells glibc (mallopt) to serve every block
from one heap (no per-thread arenas, no mmap) and never to trim it, as jemalloc or tcmalloc
would cache it (neither has a wheel on PyPI). The process then keeps its peak heap for its life,
which a training or serving process does anyway.

Transparent huge pages for the heap (`glibc.malloc.hugetlb=1`) were measured too and are not
set: fewer faults, but on this shared machine kernel time rose (huge-page zeroing and compaction).
XLA:CPU flags: none is set; the ones tried are in benchmarks/results/xla_cpu_flags_cpu.json.

Nothing is changed off Linux/glibc, when ZAYA_NO_LAUNCH_DEFAULTS=1, or when the user chose heap
settings (GLIBC_TUNABLES, a MALLOC_* variable, or an allocator in LD_PRELOAD).
"""

from __future__ import annotations

import ctypes
import os
import sys

# mallopt parameters (malloc.h): value
M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8
HEAP_SETTINGS = {M_ARENA_MAX: 1, M_MMAP_MAX: 0, M_TRIM_THRESHOLD: 2**31 - 1}


def wanted(environ: dict[str, str] | None = None) -> bool:
    """Whether this process should get the defaults (see the module docstring)."""
    environ = os.environ if environ is None else environ
    user_heap = ("GLIBC_TUNABLES" in environ or any(k.startswith("MALLOC_") for k in environ)
                 or "malloc" in environ.get("LD_PRELOAD", ""))
    return (environ.get("ZAYA_NO_LAUNCH_DEFAULTS") != "1" and not user_heap and sys.platform.startswith("linux")
            and _glibc() is not None)


def _glibc() -> ctypes.CDLL | None:
    try:
        if os.confstr("CS_GNU_LIBC_VERSION") is None:
            return None
        return ctypes.CDLL(None)
    except (ValueError, OSError):
        return None


def apply() -> bool:
    """Sets the heap defaults in this process when `wanted()` -> whether they were set."""
    if not wanted():
        return False
    libc = _glibc()
    return all(libc.mallopt(param, value) == 1 for param, value in HEAP_SETTINGS.items())
