"""Where the Python 3.11 suite's minutes go: every test's time from pytest's JUnit XML, summed by size
class and by module, with the multi-process jobs apart; prints the JSON (docs/testing.md cites it).

  python -m benchmarks.ci.suite_profile                    # runs `pytest -n 2 -q` here with a cold cache
  python -m benchmarks.ci.suite_profile --junit RUN.XML    # reads the --junitxml of a run that already ran
  python -m benchmarks.ci.suite_profile --timeline DIR     # also reads the per-worker timeline of that run
  python -m benchmarks.ci.suite_profile --before COMMIT tests/test_a.py::test_b tests/test_c.py
                                                        # a cut: those tests as COMMIT had them and as now

A test's time is its setup, call and teardown (a module fixture's training lands on the first test
that uses it). Takes as long as the suite does. The run it starts also loads this module as a pytest
plugin (`-p benchmarks.ci.suite_profile`), which writes each test phase's start, stop and xdist worker to
ZAYA_SUITE_TIMELINE/<worker>.jsonl: the profile then shows each worker's idle time (before its first
test, between tests, after its last while the other still runs), each xdist group's span, and the
module-scoped setups (trained runs, exports) that cost most.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

from benchmarks.common import REPO  # noqa: E402
MULTIPROCESS = "multiprocess"  # the xdist_group of the two-process jobs (tests/train_helpers.py)


def multiprocess_tests() -> set[str]:
    """Node ids (module::test, parameters dropped) of the tests in xdist_group("multiprocess")."""
    found = set()
    for name in sorted(os.listdir(os.path.join(REPO, "tests"))):
        if not name.startswith("test_") or not name.endswith(".py"):
            continue
        lines = open(os.path.join(REPO, "tests", name)).read().splitlines()
        for i, line in enumerate(lines):
            if f'xdist_group("{MULTIPROCESS}")' in line:
                test = next(l for l in lines[i:] if l.startswith("def test_"))
                found.add(f"tests/{name}::{test[4:test.index('(')]}")
    return found


def test_name(testcase) -> str:
    """A JUnit testcase's test name without the `@<group>` that `--dist loadgroup` appends."""
    return split_group(testcase.get("name"))[0]


def summarise(junit: str) -> dict:
    """The profile of one JUnit XML file."""
    root = ET.parse(junit).getroot()
    tests = sorted(((float(t.get("time")), t.get("classname").replace(".", "/") + ".py::" + test_name(t))
                    for t in root.iter("testcase")), reverse=True)
    total = sum(s for s, _ in tests)
    sizes = {"under_1_s": (0, 1), "1_to_10_s": (1, 10), "10_s_or_more": (10, float("inf"))}
    by_size = {k: {"tests": sum(lo <= s < hi for s, _ in tests), "seconds": round(sum(s for s, _ in tests if lo <= s < hi))}
               for k, (lo, hi) in sizes.items()}
    modules = collections.Counter()
    for s, name in tests:
        modules[name.split("::")[0]] += s
    jobs = multiprocess_tests()
    multi = [(s, n) for s, n in tests if n.split("[")[0] in jobs]
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    return {"wall_s": round(float(suite.get("time"))), "failures": int(suite.get("failures")),
            "tests": len(tests), "test_seconds": round(total), "by_size": by_size,
            "share_of_tests_10_s_or_more": round(by_size["10_s_or_more"]["seconds"] / total, 3),
            "multiprocess_jobs": {"tests": len(multi), "seconds": round(sum(s for s, _ in multi))},
            "modules": [{"module": m, "seconds": round(s)} for m, s in modules.most_common(15)],
            "slowest": [{"test": n, "seconds": round(s, 1)} for s, n in tests[:20]]}


TIMELINE = "ZAYA_SUITE_TIMELINE"  # where the plugin below writes; unset, it writes nothing


def pytest_runtest_logreport(report) -> None:
    """Plugin hook (in each xdist worker): one line per test phase in ZAYA_SUITE_TIMELINE/<worker>.jsonl."""
    folder = os.environ.get(TIMELINE)
    if not folder or not hasattr(report, "start") or hasattr(report, "node"):  # `node`: a worker's report, seen by xdist's controller
        return
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    line = {"test": report.nodeid, "when": report.when, "start": report.start, "stop": report.stop,
            "outcome": report.outcome, "load_1m": round(os.getloadavg()[0], 2)}
    with open(os.path.join(folder, f"{worker}.jsonl"), "a") as f:
        f.write(json.dumps(line) + "\n")


def split_group(nodeid: str) -> tuple[str, str | None]:
    """(the node id without the `@<group>` that --dist loadgroup appends, that group or None)."""
    if nodeid.rfind("@") > nodeid.rfind("]"):
        test, group = nodeid.rsplit("@", 1)
        return test, group
    return nodeid, None


def read_phases(folder: str) -> list[dict]:
    """The plugin's lines, each with its worker; of an xdist run, the workers' (not the controller's copies)."""
    phases = [dict(json.loads(l), worker=name.removesuffix(".jsonl")) for name in sorted(os.listdir(folder))
              if name.endswith(".jsonl") for l in open(os.path.join(folder, name))]
    if any(p["worker"] != "main" for p in phases):
        phases = [p for p in phases if p["worker"] != "main"]
    return phases


def timeline(folder: str, suite_start: float | None = None) -> dict:
    """Each worker's busy and idle time, each xdist group's span and the costliest setups, from the plugin's files."""
    phases = read_phases(folder)
    first = suite_start if suite_start is not None else min(p["start"] for p in phases)
    last = max(p["stop"] for p in phases)
    workers = {}
    for worker in sorted({p["worker"] for p in phases}):
        mine = sorted((p for p in phases if p["worker"] == worker), key=lambda p: p["start"])
        busy = sum(p["stop"] - p["start"] for p in mine)
        tests = {}
        for p in mine:  # a test's span: its setup's start to its teardown's stop
            span = tests.setdefault(p["test"], [p["start"], p["stop"]])
            span[1] = p["stop"]
        ordered = sorted(tests.items(), key=lambda t: t[1][0])
        workers[worker] = {"tests": len(tests), "busy_s": round(busy),
                           "idle_before_first_test_s": round(mine[0]["start"] - first),
                           "idle_after_last_test_s": round(last - mine[-1]["stop"]),
                           "last_tests": [{"test": n, "seconds": round(b - a, 1), "ends_s": round(b - first)}
                                          for n, (a, b) in ordered[-3:]]}
    groups = {}
    for p in phases:
        group = split_group(p["test"])[1]
        if group:
            g = groups.setdefault(group, {"worker": p["worker"], "tests": set(), "start": p["start"], "stop": p["stop"], "busy": 0.0})
            g["tests"].add(p["test"])
            g["start"], g["stop"] = min(g["start"], p["start"]), max(g["stop"], p["stop"])
            g["busy"] += p["stop"] - p["start"]
    setups = collections.Counter()
    for p in phases:
        if p["when"] == "setup":
            setups[p["test"].split("::")[0]] += p["stop"] - p["start"]
    loads = [p["load_1m"] for p in phases]
    return {"wall_from_first_test_s": round(last - first), "workers": workers,
            "load_average_1m": {"median": sorted(loads)[len(loads) // 2], "max": max(loads)},
            "groups": sorted(({"group": name, "worker": g["worker"], "tests": len(g["tests"]), "busy_s": round(g["busy"]),
                               "starts_s": round(g["start"] - first), "ends_s": round(g["stop"] - first)}
                              for name, g in groups.items()), key=lambda g: -g["busy_s"]),
            "setup_seconds_by_module": [{"module": m, "seconds": round(s)} for m, s in setups.most_common(15) if s >= 1]}


def collection_order() -> list[str]:
    """The suite's node ids in pytest's collection order."""
    listed = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-o", "addopts=", "-p", "no:xdist"],
                            cwd=REPO, capture_output=True, text=True).stdout
    return [line for line in listed.splitlines() if "::" in line]


def simulate(units: list[list[float]], workers: int = 2) -> float:
    """The wall seconds of xdist's --dist loadgroup handing out `units` (each a list of its tests'
    seconds) in this order: one unit to each worker, a second where it holds two tests or fewer, and
    another each time a worker finishes a test and holds two or fewer (LoadScopeScheduling._reschedule)."""
    queue, pending, clock = list(units), [[] for _ in range(workers)], [0.0] * workers
    for rule in (lambda w: True, lambda w: len(pending[w]) <= 2):
        for w in range(workers):
            if queue and rule(w):
                pending[w].extend(queue.pop(0))
    while any(pending):
        w = min((w for w in range(workers) if pending[w]), key=lambda w: clock[w] + pending[w][0])
        clock[w] += pending[w].pop(0)
        if queue and len(pending[w]) <= 2:
            pending[w].extend(queue.pop(0))
    return max(clock)


def scheduling(folder: str, order: list[str]) -> dict:
    """The run's tests (timeline seconds) handed out as xdist 3.8 does by default (the units with the most
    tests first, then collection order) and longest unit first (what a scheduler that knew each test's time could do)."""
    seconds, unit_of = collections.Counter(), {}
    for p in read_phases(folder):
        test, group = split_group(p["test"])
        seconds[test] += p["stop"] - p["start"]
        unit_of[test] = group or test
    units: dict[str, list[float]] = {}
    for test in order:
        if test in unit_of:
            units.setdefault(unit_of[test], []).append(seconds[test])
    by_count = sorted(units.values(), key=lambda u: -len(u))
    by_seconds = sorted(units.values(), key=lambda u: -sum(u))
    work = sum(seconds.values())
    return {"test_seconds": round(work), "even_split_s": round(work / 2),
            "simulated_wall_s": {"xdist_default_order": round(simulate(by_count)),
                                 "longest_unit_first": round(simulate(by_seconds))},
            "largest_units": [{"unit": u, "tests": len(units[u]), "seconds": round(sum(units[u]))}
                              for u in sorted(units, key=lambda u: -sum(units[u]))[:8]]}


def cpu_and_wall(targets: list[str], cache: str) -> dict:
    """Starts `pytest -p no:xdist -q targets` with the cold compilation cache `cache`; returns a callable
    that waits for it and returns its wall seconds, its CPU seconds (its subprocesses' included) and its
    closing line."""
    start = time.time()
    log = open(os.path.join(cache + ".log"), "w+")
    process = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-o", "addopts=-p no:cacheprovider",
                                *targets], cwd=REPO, env={**os.environ, "ZAYA_JAX_TEST_CACHE": cache},
                               stdout=log, stderr=subprocess.STDOUT)

    def finish() -> dict:
        _, status, usage = os.wait4(process.pid, 0)  # the CPU of every process it waited for is in its own
        process.returncode = os.waitstatus_to_exitcode(status)
        log.seek(0)
        return {"wall_s": round(time.time() - start, 1), "cpu_s": round(usage.ru_utime + usage.ru_stime, 1),
                "exit_code": process.returncode, "closing_line": log.read().strip().splitlines()[-1]}
    return finish


def before_and_after(commit: str, targets: list[str]) -> dict:
    """The targets (node ids or modules) as `commit` had them and as they are now, both at once (the same
    load) with their own cold caches: each test module of COMMIT is written beside it as
    tests/_before_<module>.py for the run and removed after."""
    written, before = [], []
    for target in targets:
        path, _, rest = target.partition("::")
        copy = os.path.join(os.path.dirname(path), "_before_" + os.path.basename(path))
        if copy not in written:
            text = subprocess.run(["git", "show", f"{commit}:{path}"], cwd=REPO, capture_output=True, text=True, check=True)
            with open(os.path.join(REPO, copy), "w") as f:
                f.write(text.stdout)
            written.append(copy)
        before.append(copy + (f"::{rest}" if rest else ""))
    try:
        with tempfile.TemporaryDirectory() as tmp:
            runs = {"before": cpu_and_wall(before, os.path.join(tmp, "before")),
                    "after": cpu_and_wall(targets, os.path.join(tmp, "after"))}
            return {"targets": targets, "before_commit": commit, **{k: finish() for k, finish in runs.items()}}
    finally:
        for copy in written:
            os.remove(os.path.join(REPO, copy))


def from_timeline(folder: str, order: list[str], suite_start: float | None = None) -> dict:
    """The timeline's part of the profile: worker idle time, groups, the two schedules."""
    return {"timeline": timeline(folder, suite_start), "scheduling": scheduling(folder, order)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--junit", help="the --junitxml of a finished run (default: run the suite now)")
    parser.add_argument("--commit", help="with --junit or --timeline: what that run tested (default: unknown)")
    parser.add_argument("--note", default="", help="with --junit or --timeline: how that run differed from its commit")
    parser.add_argument("--timeline", help="the ZAYA_SUITE_TIMELINE folder of a run that ran (alone: one stopped "
                                           "before its end, which wrote no JUnit XML)")
    parser.add_argument("--before", help="a commit: run the given tests as it had them and as they are now")
    parser.add_argument("targets", nargs="*", help="with --before: node ids or test modules")
    parser.add_argument("--keep", help="without --junit: an empty folder that keeps the run's JUnit XML and timeline")
    args = parser.parse_args()
    load = None if args.junit or args.timeline else round(os.getloadavg()[0], 2)  # a finished run's is not known here
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    if args.before:
        profile, source = before_and_after(args.before, args.targets), "a cut: the tests before and after, at once"
    elif args.junit or args.timeline:
        profile, commit = summarise(args.junit) if args.junit else {}, args.commit
        if args.timeline:
            profile.update(from_timeline(args.timeline, collection_order()))
        what = f"the JUnit XML {os.path.basename(args.junit)}" if args.junit else "the timeline"
        source = f"{what} of a cold-cache `pytest -n 2 -q` {args.note}".strip()
    else:
        with tempfile.TemporaryDirectory() as scratch:
            tmp = args.keep or scratch
            junit, phases = os.path.join(tmp, "suite.xml"), os.path.join(tmp, "timeline")
            os.mkdir(phases)
            env = {**os.environ, "ZAYA_JAX_TEST_CACHE": os.path.join(tmp, "cache"), TIMELINE: phases,
                   "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
            start = time.time()
            subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "-q", "-p", "benchmarks.ci.suite_profile", f"--junitxml={junit}"],
                           cwd=REPO, env=env, stdout=open(os.path.join(tmp, "pytest.log"), "w"), stderr=subprocess.STDOUT)
            profile, source = summarise(junit), "a cold-cache `pytest -n 2 -q` of this checkout"
            profile.update(from_timeline(phases, collection_order(), start))
    print(json.dumps({"source": source, "commit": commit, "python": sys.version.split()[0], "cpu_count": os.cpu_count(),
                      "load_average_1m_at_start": load, **profile}, indent=1))


if __name__ == "__main__":
    main()
