"""How many memory mappings a pytest worker holds as it runs test modules, with tests/conftest.py's
`jax.clear_caches()` after each module ("cleared") and with that call made a no-op ("kept", the
suite before the fix): one process runs the modules in order, as one xdist worker runs its share,
and counts the lines of /proc/self/maps after every test. Linux refuses a process more mappings than
vm.max_map_count (65,530 by default); XLA:CPU then segfaulted loading a program (docs/testing.md).

  .venv312/bin/python -m benchmarks.ci.worker_mappings                # the default modules, below
  .venv312/bin/python -m benchmarks.ci.worker_mappings tests/test_grpo_training.py tests/test_serve.py

Both modes share one fresh compilation cache (the first fills it, as a CI run's first worker does);
prints JSON: per mode the highest count and the test at which it was reached, the count after each
module, the tests' closing line and the wall time; with the limit and the stack.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from benchmarks.common import REPO  # noqa: E402

from benchmarks.common import stack  # noqa: E402

# the modules a 3.12 worker ran, in its order, up to the test at which it segfaulted (at the last)
DEFAULT_MODULES = [
    "tests/test_grpo_training.py", "tests/test_engine_serving.py", "tests/test_grpo_loss.py", "tests/test_serve.py",
    "tests/test_serve_mesh.py", "tests/test_engine_mesh.py", "tests/test_train_faults.py", "tests/test_parallel.py",
    "tests/test_vision_generate.py", "tests/test_plan_vision.py", "tests/test_vision_training.py",
    "tests/test_engine_extend.py", "tests/test_engine_images.py", "tests/test_vision_data.py",
    "tests/test_checkpoint_topology.py", "tests/test_vision_accounting.py", "tests/test_serve_images.py",
    "tests/test_vision_long_attention.py", "tests/test_attention_core.py", "tests/test_bf16_numerics.py",
]

# runs in the measured process: pytest over argv[3:] with a plugin that counts mappings after each
# test and appends the count to the file argv[2]; argv[1] is the mode; prints one JSON line
RUNNER = r"""
import json, sys
import pytest

mode, progress, modules = sys.argv[1], sys.argv[2], sys.argv[3:]
if mode == "kept":
    import jax
    jax.clear_caches = lambda: None  # what conftest's module fixture calls

def mappings():
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)

class Count:
    def __init__(self):
        self.peak, self.peak_at, self.after_module, self.closing = 0, None, {}, None
    def pytest_runtest_logfinish(self, nodeid, location):
        count = mappings()
        if count > self.peak:
            self.peak, self.peak_at = count, nodeid
        self.after_module[nodeid.split("::")[0]] = count
        with open(progress, "a") as f:  # what is left if the process dies
            f.write(json.dumps({"test": nodeid, "mappings": count}) + "\n")
    def pytest_terminal_summary(self, terminalreporter):
        stats = terminalreporter.stats
        self.closing = {key: len(stats.get(key, [])) for key in ("passed", "failed", "skipped", "error")}

count = Count()
code = pytest.main(["-q", "-o", "addopts=", "-p", "no:cacheprovider", "-p", "no:xdist", *modules], plugins=[count])
print(json.dumps({"exit": int(code), "peak": count.peak, "peak_at": count.peak_at,
                  "after_module": count.after_module, "tests": count.closing}))
"""


def measure(mode: str, modules: list[str], cache: str) -> dict:
    env = {**os.environ, "PYTHONPATH": REPO, "ZAYA_JAX_TEST_CACHE": cache, "JAX_PLATFORMS": "cpu"}
    progress = os.path.join(cache, f"{mode}.jsonl")
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", RUNNER, mode, progress, *modules], cwd=REPO, env=env,
                          capture_output=True, text=True)
    wall = time.perf_counter() - start
    lines = [line for line in done.stdout.splitlines() if line.startswith('{"exit"')]
    if lines:
        return {**json.loads(lines[-1]), "wall_s": round(wall, 1)}
    # the process died before it printed (a segfault, its mappings run out): where, from its progress
    with open(progress) as f:
        counts = [json.loads(line) for line in f]
    peak = max(counts, key=lambda c: c["mappings"])
    fault = next((line for line in done.stderr.splitlines() if line.startswith("Fatal Python error")), None)
    return {"exit": done.returncode, "died": True, "fault": fault, "tests_finished": len(counts),
            "last_finished": counts[-1], "peak": peak["mappings"], "peak_at": peak["test"],
            "wall_s": round(wall, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("modules", nargs="*", default=DEFAULT_MODULES, help="test modules, run in this order")
    args = parser.parse_args()
    missing = [m for m in args.modules if not os.path.isfile(os.path.join(REPO, m))]
    if missing:
        parser.error(f"no such test module: {missing[0]}")
    with open("/proc/sys/vm/max_map_count") as f:
        limit = int(f.read())
    with tempfile.TemporaryDirectory() as cache:
        modes = {mode: measure(mode, args.modules, cache) for mode in ("cleared", "kept")}
    print(json.dumps({"stack": stack(), "vm_max_map_count": limit, "modules": args.modules,
                      "load_average_1min": os.getloadavg()[0], **modes}, indent=2))


if __name__ == "__main__":
    main()
