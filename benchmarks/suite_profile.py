"""Where the Python 3.11 suite's minutes go: every test's time from pytest's JUnit XML, summed by size
class and by module, with the multi-process jobs apart; prints the JSON (docs/testing.md cites it).

  python benchmarks/suite_profile.py                    # runs `pytest -n 2 -q` here with a cold cache
  python benchmarks/suite_profile.py --junit RUN.XML    # reads the --junitxml of a run that already ran

A test's time is its setup, call and teardown (a module fixture's training lands on the first test
that uses it). Takes as long as the suite does.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
    return testcase.get("name").split("@")[0]


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--junit", help="the --junitxml of a finished run (default: run the suite now)")
    parser.add_argument("--commit", help="with --junit: what that run tested (default: unknown)")
    parser.add_argument("--note", default="", help="with --junit: how that run differed from its commit")
    args = parser.parse_args()
    load = None if args.junit else round(os.getloadavg()[0], 2)  # a finished run's load is not known here
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    if args.junit:
        profile, commit = summarise(args.junit), args.commit
        source = f"the JUnit XML {os.path.basename(args.junit)} of a cold-cache `pytest -n 2 -q` {args.note}".strip()
    else:
        with tempfile.TemporaryDirectory() as tmp:
            junit = os.path.join(tmp, "suite.xml")
            subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "-q", f"--junitxml={junit}"], cwd=REPO,
                           env={**os.environ, "ZAYA_JAX_TEST_CACHE": os.path.join(tmp, "cache")},
                           stdout=subprocess.DEVNULL)
            profile, source = summarise(junit), "a cold-cache `pytest -n 2 -q` of this checkout"
    print(json.dumps({"source": source, "commit": commit, "python": sys.version.split()[0], "cpu_count": os.cpu_count(),
                      "load_average_1m_at_start": load, **profile}, indent=1))


if __name__ == "__main__":
    main()
