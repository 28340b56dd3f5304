"""Fault handling in the loop: non-finite steps, rollback, stop signals, and the exit they end in.

Non-finite loss or gradient: the step itself skips the update (step.py) and counts it in
`skipped_steps`; the state's `nonfinite_streak` counts such steps in a row. Once it reaches
train.max_nonfinite_streak, the loop rolls back: parameters, optimizer and controller state
return to the last checkpoint, while the data iterator keeps going (replaying the same batches
would most likely fail the same way). A run that would need more than train.max_rollbacks
rollbacks stops with `TrainingFailed` (exit EXIT_FAILED). A checkpoint step (or the final step)
whose last step was non-finite is not saved, and the log says so.

SIGTERM / SIGINT (a preempted or cancelled job): `install()` puts the handlers in place at the
very start of the process (`python -m zaya_jax.train` calls it before anything else), so a signal
during start-up is kept too. The handler only records the signal. At every step boundary the
processes agree on it (`agreed()`: the largest signal number over all processes, one tiny
collective per step), so a signal to any one process makes every process stop after the same
step, save it, wait for the write and exit with EXIT_PREEMPTED. Further SIGTERMs (a scheduler
repeating itself) change nothing; a second SIGINT exits at once, as Python's default would.

A stop before the first step boundary, while the state is being built (an initialisation compile
or a restore: minutes for a large model, or for a process whose compilation cache misses), is not
left waiting for that: `build_unless_stopped` builds the state in a worker thread while the main
thread watches for a signal, and the processes meet through a key-value board rather than a
collective. The CLI then exits EXIT_PREEMPTED at once (`exit_at_once`), saving nothing: nothing
was trained.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import sys
import threading
import time
from typing import Callable, TypeVar

T = TypeVar("T")


class TrainingFailed(RuntimeError):
    """The run cannot go on (e.g. the rollback budget is spent): reported as one line, exit EXIT_FAILED."""


def should_roll_back(nonfinite_streak: int, max_streak: int) -> bool:
    return max_streak > 0 and nonfinite_streak >= max_streak


def check_rollback_budget(rollbacks_done: int, max_rollbacks: int, step: int, streak: int) -> None:
    """Raises TrainingFailed when one more rollback would exceed train.max_rollbacks."""
    if rollbacks_done >= max_rollbacks:
        raise TrainingFailed(f"{streak} non-finite steps in a row at step {step} after {rollbacks_done} rollback(s) "
                             f"(train.max_rollbacks={max_rollbacks}): the run diverges; lower the learning rate "
                             "or inspect the data, then resume from the last checkpoint")


class StopSignal:
    """Records SIGTERM and SIGINT while installed; `requested` is this process's first signal."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.requested: int | None = None
        self._previous: dict = {}

    def _handle(self, signum, frame):
        del frame
        if self.requested is not None and signum == signal.SIGINT == self.requested:
            sys.exit(128 + signum)  # a second Ctrl-C: stop now
        if self.requested is None:
            self.requested = signum

    @property
    def installed(self) -> bool:
        return bool(self._previous)

    def install(self) -> "StopSignal":
        if threading.current_thread() is threading.main_thread() and not self.installed:
            for sig in self.SIGNALS:  # only the main thread may install handlers
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def agreed(self, failing: bool = False) -> int:
        """What every process does now: 0 go on, a signal number: stop (the largest any process
        received), PEER_FAILED: some process is `failing` (its checkpoint write failed).

        A collective when there are several processes: called by all of them at the same step boundary.
        """
        from zaya_jax.parallel import distributed  # not at import: install() runs before jax is imported
        return distributed.max_over_processes(PEER_FAILED if failing else (self.requested or 0))


PROCESS_STOP = StopSignal()


def install() -> StopSignal:
    """Catches SIGTERM / SIGINT from now on, for the whole process (the CLI's first call)."""
    return PROCESS_STOP.install()


PEER_FAILED = 1 << 20  # agreed() when some process failed to write its checkpoint


@contextlib.contextmanager
def catching_stops():
    """PROCESS_STOP, installed for the duration if the process did not install it at start."""
    installed_here = not PROCESS_STOP.installed
    PROCESS_STOP.install()
    try:
        yield PROCESS_STOP
    finally:
        if installed_here:
            PROCESS_STOP.uninstall()
            PROCESS_STOP.requested = None


class StoppedDuringStartup(Exception):
    """A stop signalled to some process before every process had built its state."""

    def __init__(self, signum: int):
        super().__init__(f"signal {signum}: stopping during start-up, before training; nothing new to save")
        self.signum = signum


_startups = itertools.count()  # one board directory per build_unless_stopped call of this process


def build_unless_stopped(build: Callable[[], T]) -> T:
    """`build()` once every process has built its own, unless a stop comes first (raises StoppedDuringStartup).

    Without the stop handlers installed (a notebook, a test): build() as it is. With them (the CLI),
    build() runs in a worker thread: a signal's Python handler runs only between bytecodes of the
    main thread, which an XLA compilation holds for as long as it takes. The main thread instead
    polls: a process that has a signal before its build is done posts `stop` and raises; one whose
    build is done posts `ready`. Both decisions are taken in the main thread, one excluding the
    other, so either every process posts ready and all return (later signals are agreed at the
    step boundaries), or some process posted stop and every process raises once it reads it (within
    a poll, at most 0.5 s). Errors of build() are raised here.
    """
    if not PROCESS_STOP.installed:
        return build()
    from zaya_jax.parallel import distributed  # not at import: install() runs before jax is imported
    import jax
    board, me, count = f"zaya_startup_{next(_startups)}", str(jax.process_index()), jax.process_count()
    outcome: dict = {}

    def work():
        try:
            outcome["value"] = build()
        except BaseException as e:  # pylint: disable=broad-except  (raised by the main thread)
            outcome["error"] = e

    worker = threading.Thread(target=work, name="zaya-initial-state", daemon=True)
    worker.start()
    ready, poll, deadline = False, 0.02, time.monotonic() + distributed.barrier_timeout_s()
    while True:
        if not ready:
            if PROCESS_STOP.requested:
                distributed.post(f"{board}/stop/{me}", str(PROCESS_STOP.requested))
                raise StoppedDuringStartup(PROCESS_STOP.requested)
            if not worker.is_alive():
                if "error" in outcome:
                    raise outcome["error"]
                distributed.post(f"{board}/ready/{me}", "1")
                ready = True
        stops = distributed.posted(f"{board}/stop/")
        if stops:
            raise StoppedDuringStartup(max(int(v) for v in stops.values()))
        if ready:
            waiting = set(map(str, range(count))) - set(distributed.posted(f"{board}/ready/"))
            if not waiting:
                return outcome["value"]
            if time.monotonic() > deadline:
                raise RuntimeError(f"processes {sorted(waiting, key=int)} did not build their state within "
                                   f"{distributed.barrier_timeout_s()} s (ZAYA_BARRIER_TIMEOUT_S)")
            time.sleep(poll)
        else:
            worker.join(poll)
        poll = min(2 * poll, 0.5)


def exit_at_once(code: int) -> None:
    """Ends the process with `code` without waiting for a worker thread (a build_unless_stopped build
    may still be compiling): flushes the output, leaves jax.distributed (every process of a
    start-up stop does, together), then os._exit."""
    sys.stdout.flush()
    sys.stderr.flush()
    if "jax" in sys.modules:
        import jax
        jax.distributed.shutdown()
    os._exit(code)
