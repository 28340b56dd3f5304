"""XLA_FLAGS of the suite's processes: fake CPU devices, patient collectives, cheap compiles; and
the persistent compilation cache they share (COMPILATION_CACHE).

XLA:CPU ends a collective whose in-process participants have not all arrived within 40 s; on two
cores loaded by two test workers a device thread can be descheduled that long (seen with
distributed Muon's all-to-alls), so the fake devices wait 300 s before calling it a deadlock.

The suite's programs are tiny, so compiling them costs more than running them: LLVM at -O0
(`--xla_backend_optimization_level=0`) makes a cold run of tests/test_train_step.py take about 0.6
of its time at the default level (benchmarks/results/suite_compile_level_cpu.json). XLA's own HLO
passes (fusion, layout, sharding) are the same at every level, so what the tests prove about the
compiled program does not change; the benchmarks, which time code, never use these flags. The
code is slower at -O0, so the runs of RUNTIME_BOUND configs (the demo: its 30- to 260-step runs of a wider model)
compile at the default level (the bf16 reduction test's 60 demo steps took 360 s at -O0).

jax 0.10's XLA:CPU still has the loop emitters that came before its MLIR fusion emitters
(`--xla_cpu_use_fusion_emitters=false`); they compile faster
(benchmarks/results/suite_compile_level_cpu.json, docs/testing.md). Like -O0 they change code
generation only, after every HLO pass. jax 0.11's XLA has no other emitters (the flag is gone), so
the 3.12 stack compiles with the fusion emitters, and the suite tests both.
"""

import functools
import importlib.metadata
import os
import tempfile

CHEAP_COMPILE = "--xla_backend_optimization_level=0"

LEGACY_EMITTERS = "--xla_cpu_use_fusion_emitters=false"

RUNTIME_BOUND = ("configs/demo.py",)

# the persistent compilation cache every process of the suite shares (the CLIs' JAX_COMPILATION_CACHE_DIR)
COMPILATION_CACHE = os.environ.get("ZAYA_JAX_TEST_CACHE", os.path.join(tempfile.gettempdir(), "zaya_jax_jit_cache"))


@functools.cache  # xla_flags runs for every subprocess the suite starts
def has_legacy_emitters() -> bool:
    """Whether the installed jaxlib's XLA:CPU still has its pre-MLIR loop emitters (jaxlib < 0.11),
    read without importing jax (XLA_FLAGS must be set first)."""
    major, minor = (int(part) for part in importlib.metadata.version("jaxlib").split(".")[:2])
    return (major, minor) < (0, 11)


def compile_flags(cheap_compile: bool = True) -> str:
    """The XLA_FLAGS of a test process but its device count: patient collectives, and unless not
    cheap_compile LLVM at -O0 and the legacy emitters where jaxlib has them (launch/local.sh's
    processes take these: the script adds the device count; tests/test_suite_flags.py checks them)."""
    flags = "--xla_cpu_collective_call_terminate_timeout_seconds=300"
    if not cheap_compile:
        return flags
    return f"{flags} {CHEAP_COMPILE}" + (f" {LEGACY_EMITTERS}" if has_legacy_emitters() else "")


def xla_flags(devices: int, cheap_compile: bool = True) -> str:
    """XLA_FLAGS for a test process with `devices` fake CPU devices (compile_flags)."""
    return f"--xla_force_host_platform_device_count={devices} {compile_flags(cheap_compile)}"


FAKE_DEVICES = xla_flags(8)
