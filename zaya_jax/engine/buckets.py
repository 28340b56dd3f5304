"""The sizes the engine compiles a call for, so a varying count needs few programs."""

from __future__ import annotations


def doubling_buckets(first: int, last: int) -> tuple[int, ...]:
    """first, 2 first, 4 first, ... below `last`, then `last` (() when last is 0): the smallest
    bucket holding a count of up to `last` is at most twice it (or `last`)."""
    buckets, size = [], first
    while size < last:
        buckets.append(size)
        size *= 2
    return (*buckets, last) if last else ()
