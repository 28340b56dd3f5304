"""What XLA:CPU's code generation costs the test suite: one test module, run from a cold compilation
cache at XLA:CPU's default level, at LLVM -O0 (tests/fake_devices.CHEAP_COMPILE), and, where jaxlib
still has them (< 0.11), at -O0 with the legacy loop emitters instead of the MLIR fusion emitters
(fake_devices.LEGACY_EMITTERS): the last is what the suite uses; prints the JSON (docs/testing.md
cites it).

  python -m benchmarks.ci.suite_compile_level [--tests tests/test_train_step.py]

The suite's programs are tiny, so their compiles cost more than their runs; the ratio is the
suite-wide saving to expect where compiles dominate. Each variant gets a new, empty cache folder.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tempfile
import time

from benchmarks.common import REPO  # noqa: E402
from tests.fake_devices import CHEAP_COMPILE, LEGACY_EMITTERS, has_legacy_emitters, xla_flags  # noqa: E402

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
    variants = {"default_level": default_flags, "llvm_o0": f"{default_flags} {CHEAP_COMPILE}"}
    if has_legacy_emitters():
        variants["llvm_o0_legacy_emitters"] = f"{default_flags} {CHEAP_COMPILE} {LEGACY_EMITTERS}"
    assert list(variants.values())[-1] == xla_flags(8), "the last variant is the suite's own flags"
    load_start = os.getloadavg()[0]
    results = {name: {"xla_flags": flags, **run_module(args.tests, flags)} for name, flags in variants.items()}
    default_s = results["default_level"]["wall_s"]
    print(json.dumps({
        "tests": args.tests, "cpu_count": os.cpu_count(), "jaxlib": importlib.metadata.version("jaxlib"), **results,
        "ratio_vs_default": {name: round(r["wall_s"] / default_s, 3) for name, r in results.items()},
        "the_suite_uses": list(variants)[-1],
        "load_average_1m_start_end": [round(load_start, 2), round(os.getloadavg()[0], 2)],
    }, indent=1))


if __name__ == "__main__":
    main()
