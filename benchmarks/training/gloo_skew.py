"""How far apart the 2 processes of a CPU job (gloo collectives) may reach a collective.

  python -m benchmarks.training.gloo_skew [--delays 25,40] [--timeout_flag 600]

Each case starts 2 processes of one jax.distributed job on this machine (1 CPU device each,
started by zaya_jax.parallel.distributed.initialize from the environment launch/local.sh sets),
which compile a jitted sum of an array split over the two devices (an all-reduce between the
processes, over gloo) and wait at a barrier; then:
  first   process 1 sleeps DELAY s before the job's first collective, where gloo connects the two
          devices (jaxlib creates one gloo context per group of devices, at its first collective)
  later   both run the collective once, then process 1 sleeps DELAY s before the second
With --timeout_flag S every case also runs with XLA_FLAGS=--xla_cpu_collective_timeout_seconds=S
(XLA:CPU's limit on one collective operation, 30 minutes by default).
Prints one JSON object: per case, each process's exit code, how long each waited in the
collective process 1 was late for, and the error it raised there (a failed process then exits).
Measured on both stacks: run_all writes benchmarks/results/gloo_skew_cpu_py311.json (Python 3.11,
jax 0.10.2) and gloo_skew_cpu_py312.json (Python 3.12, jax 0.11.2), each from its own interpreter
(launch/README.md quotes them).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

PHASES = ("first", "later")


def worker(phase: str, delay: float) -> None:
    """One process of the job (ZAYA_* in the environment)."""
    from zaya_jax.parallel import distributed
    distributed.initialize()
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh = Mesh(np.asarray(jax.devices()), ("data",))
    x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("data")), np.ones((1,), np.float32), (2,))
    total = jax.jit(lambda a: a.sum(), out_shardings=NamedSharding(mesh, P())).lower(x).compile()
    distributed.barrier("compiled")
    late = jax.process_index() == 1
    if phase == "later":
        jax.block_until_ready(total(x))
    if late:
        time.sleep(delay)
    start = time.perf_counter()
    try:
        outcome = {"sum": float(jax.block_until_ready(total(x)))}
    except Exception as err:  # the collective failed: its message (the process is then ended, not shut down)
        outcome = {"error": str(err).splitlines()[0][:600]}
    print(json.dumps({"waited_s": time.perf_counter() - start, **outcome}), flush=True)
    if "error" in outcome:
        os._exit(1)  # jax.distributed's shutdown would wait for the peer this process gave up on


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_case(phase: str, delay: float, timeout_flag: int | None) -> dict:
    """Both processes of one case -> their exit codes, process 0's wait, their last error lines."""
    port, started = _free_port(), time.perf_counter()
    xla_flags = f"--xla_cpu_collective_timeout_seconds={timeout_flag}" if timeout_flag else ""
    processes = [subprocess.Popen([sys.executable, "-m", "benchmarks.training.gloo_skew", "--worker", phase, "--delay", str(delay)],
                                  env={**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags,
                                       "ZAYA_COORDINATOR": f"127.0.0.1:{port}", "ZAYA_NUM_PROCESSES": "2",
                                       "ZAYA_PROCESS_ID": str(i), "PYTHONPATH": os.getcwd()},
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    outputs = [p.communicate(timeout=delay + 600) for p in processes]
    result = {"phase": phase, "delay_s": delay, "xla_flags": xla_flags,
              "wall_s": round(time.perf_counter() - started, 1), "exit_codes": [p.returncode for p in processes]}
    for i, (out, _) in enumerate(outputs):
        record = next((json.loads(line) for line in out.splitlines() if line.startswith("{")), {})
        if "waited_s" in record:
            result[f"process{i}_waited_s"] = round(record["waited_s"], 1)
        if "error" in record:
            result[f"process{i}_error"] = record["error"]
    result["survived"] = result["exit_codes"] == [0, 0]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--delays", default="25,40", help="comma-separated seconds process 1 sleeps")
    parser.add_argument("--timeout_flag", type=int, default=600,
                        help="also run each case with --xla_cpu_collective_timeout_seconds=S (0: not)")
    parser.add_argument("--worker", choices=PHASES, help=argparse.SUPPRESS)
    parser.add_argument("--delay", type=float, default=0.0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.delay)
        return
    import jax
    flags = [None] + ([args.timeout_flag] if args.timeout_flag else [])
    cases = [run_case(phase, float(delay), flag) for flag in flags for phase in PHASES
             for delay in args.delays.split(",")]
    print(json.dumps({"jax": jax.__version__, "python": sys.version.split()[0],
                      "load_average": os.getloadavg(), "cases": cases}, indent=1))


if __name__ == "__main__":
    main()
