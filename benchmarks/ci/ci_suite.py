"""The whole `.ci/run` on a clean clone, timed: each stack's install and pytest wall time, its closing
line and its 20 slowest tests, and the machine's load; prints the JSON (docs/testing.md cites it).

  python -m benchmarks.ci.ci_suite                 # clones HEAD into a temporary folder and runs .ci/run there
  python -m benchmarks.ci.ci_suite --log CI.LOG    # reads the output of a .ci/run that already ran
  python -m benchmarks.ci.ci_suite --busy 2        # with 2 processes spinning on the CPU throughout: the
                                                # suite's 2 workers + 2 = a load of about 4

The clone gets a compilation cache of its own (ZAYA_JAX_TEST_CACHE in a new temporary folder), so
nothing compiled by an earlier run is reused, as on a new CI machine. Takes as long as CI does.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from benchmarks.common import REPO  # noqa: E402
STACK = re.compile(r"^Python (3\.\d+) stack: pytest wall time (\d+) s(?:, load average ([\d.]+))?")
INSTALLED = re.compile(r"^Python 3\.11 stack installed after (\d+) s")
TOTAL = re.compile(r"^whole \.ci/run: (\d+) s(?:, load average ([\d.]+))?")
CLOSING = re.compile(r"^=*\s*(\d+ passed.*) in [\d.]+s")
SLOW = re.compile(r"^([\d.]+)s (call|setup|teardown)\s+(\S+)")


def _number(text: str | None) -> float | None:
    return None if text is None else float(text)  # logs of .ci/run before it printed the load have none


def parse(log: str) -> dict:
    """The figures .ci/run printed (its timing lines, each suite's closing line and --durations list)."""
    stacks, slowest, closing = [], [[]], []
    result: dict = {}
    for line in log.splitlines():
        if m := INSTALLED.match(line):
            result["install_311_s"] = int(m[1])
        elif m := SLOW.match(line):
            slowest[-1].append({"seconds": float(m[1]), "phase": m[2], "test": m[3]})
        elif m := CLOSING.match(line):
            closing.append(m[1])
        elif m := STACK.match(line):
            stacks.append({"python": m[1], "pytest_wall_s": int(m[2]), "load_average_1m_at_end": _number(m[3])})
            slowest.append([])
        elif m := TOTAL.match(line):
            result.update(whole_run_s=int(m[1]), load_average_1m_at_end=_number(m[2]))
    if len(stacks) != 2 or len(closing) != 2 or "whole_run_s" not in result:
        raise ValueError(f"not a finished .ci/run log: {len(stacks)} stacks timed, {len(closing)} closing lines")
    for stack, tests, line in zip(stacks, slowest, closing):
        stack.update(closing_line=line, slowest=tests)
    return {**result, "stacks": stacks}


def _spin() -> None:
    while True:
        pass


def sample_load(samples: list[float], stop: threading.Event, every_s: float = 30) -> None:
    """Appends the 1-minute load average to `samples` every `every_s` seconds until `stop` is set."""
    while not stop.wait(every_s):
        samples.append(os.getloadavg()[0])


def run_ci(busy: int = 0) -> tuple[str, float, str, list[float]]:
    """(the output of .ci/run on a clean clone of HEAD, the load average at its start, HEAD, the 1-minute
    load average every 30 s while it ran), with `busy` processes spinning on the CPU while it runs."""
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
    with tempfile.TemporaryDirectory() as root:
        clone = os.path.join(root, "clone")
        subprocess.run(["git", "clone", "-q", REPO, clone], check=True)
        load = os.getloadavg()[0]
        env = {**os.environ, "CI": "true", "ZAYA_JAX_TEST_CACHE": os.path.join(root, "jit_cache")}
        spinners = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(busy)]
        for spinner in spinners:
            spinner.start()
        samples, stop = [], threading.Event()
        sampler = threading.Thread(target=sample_load, args=(samples, stop), daemon=True)
        sampler.start()
        try:
            done = subprocess.run(["bash", ".ci/run"], cwd=clone, env=env, stdin=subprocess.DEVNULL,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        finally:
            stop.set()
            for spinner in spinners:
                spinner.terminate()
        if done.returncode:
            raise SystemExit(f".ci/run failed (exit {done.returncode}):\n{done.stdout[-3000:]}")
        return done.stdout, load, head, samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log", help="the output of a finished .ci/run (default: run one now)")
    parser.add_argument("--busy", type=int, default=0, help="processes spinning on the CPU during the run")
    args = parser.parse_args()
    if args.log:
        with open(args.log) as f:
            log = f.read()
        source, load, head, samples = f"the log {os.path.basename(args.log)} of a clean-clone .ci/run", None, None, []
    else:
        start = time.time()
        log, load, head, samples = run_ci(args.busy)
        source = f"a clean clone of {head[:12]}, run by this script ({time.time() - start:.0f} s)"
    during = {"load_average_1m_during": {"every_s": 30, "median": round(statistics.median(samples), 2),
                                         "max": round(max(samples), 2)}} if samples else {}
    print(json.dumps({"source": source, "commit": head, "cpu_count": os.cpu_count(), "busy_processes": args.busy,
                      "load_average_1m_at_start": load, **during, **parse(log)}, indent=2))


if __name__ == "__main__":
    sys.exit(main())
