"""What LLVM's optimization level costs the test suite: one test module, run from a cold compilation
cache at XLA:CPU's default level and at -O0 (tests/fake_devices.CHEAP_COMPILE, what the suite
uses); prints the JSON (docs/testing.md cites it).

  python benchmarks/suite_compile_level.py [--tests tests/test_train_step.py]

The suite's programs are tiny, so their compiles cost more than their runs; the ratio is the
suite-wide saving to expect where compiles dominate. Each variant gets a new, empty cache folder.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests"))
from fake_devices import xla_flags  # noqa: E402

PASSED = re.compile(r"(\d+) passed")


def run_module(tests: list[str], flags: str) -> dict:
    """`pytest -n 0 tests` in a fresh process with XLA_FLAGS=flags and an empty cache -> wall seconds, passed."""
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "XLA_FLAGS": flags, "ZAYA_JAX_TEST_CACHE": cache, "JAX_PLATFORMS": "cpu"}
        start = time.perf_counter()
        out = subprocess.run([sys.executable, "-m", "pytest", "-n", "0", "-q", *tests], cwd=REPO, env=env,
                             capture_output=True, text=True)
        seconds = time.perf_counter() - start
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(tests)} failed with XLA_FLAGS={flags!r}:\n{out.stdout[-3000:]}")
    return {"wall_s": round(seconds, 1), "passed": int(PASSED.search(out.stdout)[1])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tests", nargs="+", default=["tests/test_train_step.py"])
    args = parser.parse_args()
    default_flags = xla_flags(8, cheap_compile=False)
    load_start = os.getloadavg()[0]
    default = run_module(args.tests, default_flags)
    cheap = run_module(args.tests, xla_flags(8))
    print(json.dumps({
        "tests": args.tests, "cpu_count": os.cpu_count(),
        "default_level": {"xla_flags": default_flags, **default},
        "cheap_compile": {"xla_flags": xla_flags(8), **cheap},
        "ratio_cheap_vs_default": round(cheap["wall_s"] / default["wall_s"], 3),
        "load_average_1m_start_end": [round(load_start, 2), round(os.getloadavg()[0], 2)],
    }, indent=1))


if __name__ == "__main__":
    main()
