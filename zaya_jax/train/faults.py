"""Fault handling in the loop: non-finite steps, rollback, and stop signals.

Non-finite loss or gradient: the step itself skips the update (step.py) and counts it in
`skipped_steps`; the state's `nonfinite_streak` counts such steps in a row. Once it reaches
train.max_nonfinite_streak, the loop rolls back: parameters, optimizer and controller state
return to the last checkpoint, while the data iterator keeps going (replaying the same batches
would most likely fail the same way).

SIGTERM / SIGINT (a preempted or cancelled job): the handler only raises a flag; the loop
finishes the current step, saves a checkpoint, waits for it and exits. A second signal exits at
once, as Python's default would.
"""

from __future__ import annotations

import signal
import sys
import threading


def should_roll_back(nonfinite_streak: int, max_streak: int) -> bool:
    return max_streak > 0 and nonfinite_streak >= max_streak


class StopSignal:
    """Catches SIGTERM and SIGINT while installed (a context manager); `requested` tells the loop."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.requested: int | None = None
        self._previous = {}

    def _handle(self, signum, frame):
        del frame
        if self.requested is not None:
            sys.exit(128 + signum)
        self.requested = signum

    def __enter__(self) -> "StopSignal":
        if threading.current_thread() is not threading.main_thread():
            return self  # only the main thread may install handlers (e.g. a trainer run from a worker thread)
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
