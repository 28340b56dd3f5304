"""Measured GPU rates for the planner's `--calibration FILE` (format: zaya_jax.hardware).

`measure()` (GPU only, a few seconds; part of benchmarks/gpu/gpu_selftest.py) times on the devices of
this process:
  matmul     one dense bf16 [8192, 8192] @ [8192, 8192] matmul -> TFLOP/s
  hbm        an elementwise op on a 1 GiB bf16 array (reads and writes it) -> GB/s
  all_reduce a psum of 256 MiB bf16 per device over all local devices (one node), as bus
             bandwidth 2 (n - 1) / n x bytes / time (the NCCL/RCCL tests' convention) -> GB/s;
             absent with one device
Across nodes cannot be measured from one process, so `inter_node_gbps` is never written: the
planner keeps the profile's assumed fraction for it (and for any rate that failed here).

`calibration(measured)` turns that dict into the planner's flat JSON:
  {"device_kind", "matmul_tflops", "hbm_gbps", "intra_node_gbps"}   (rates that were measured)
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from benchmarks.common import device_time
from benchmarks.gpu.gpu_kernels import guarded

MATMUL_N = 8192
HBM_ELEMENTS = 2**29            # bf16: 1 GiB
ALL_REDUCE_ELEMENTS = 2**27     # bf16 per device: 256 MiB
ITERS = 10
FIELDS = {"matmul": ("matmul_tflops", "tflops"), "hbm": ("hbm_gbps", "gbps"),
          "all_reduce": ("intra_node_gbps", "gbps")}


def measure() -> dict:
    """{"device_kind", "matmul": {"tflops"}, "hbm": {"gbps"}[, "all_reduce": {"gbps", "devices"}]};
    a failed measurement is {"error": ...} (benchmarks.gpu.gpu_kernels.guarded)."""
    def seconds(fn, *args) -> float:
        return device_time(fn, args, ITERS)["seconds"]

    def matmul() -> dict:
        a = jnp.ones((MATMUL_N, MATMUL_N), jnp.bfloat16)
        return {"tflops": 2.0 * MATMUL_N**3 / seconds(jax.jit(jnp.matmul), a, a) / 1e12}

    def hbm() -> dict:
        x = jnp.ones((HBM_ELEMENTS,), jnp.bfloat16)
        return {"gbps": 2 * x.nbytes / seconds(jax.jit(lambda x: x * 2), x) / 1e9}

    def all_reduce() -> dict:
        devices = jax.local_devices()
        mesh = Mesh(np.array(devices), ("d",))
        x = jax.device_put(jnp.ones((len(devices) * ALL_REDUCE_ELEMENTS,), jnp.bfloat16), NamedSharding(mesh, P("d")))
        psum = jax.jit(jax.shard_map(lambda s: jax.lax.psum(s, "d"), mesh=mesh, in_specs=P("d"), out_specs=P("d")))
        n, nbytes = len(devices), ALL_REDUCE_ELEMENTS * 2
        return {"gbps": 2 * (n - 1) / n * nbytes / seconds(psum, x) / 1e9, "devices": n}

    out = {"device_kind": jax.devices()[0].device_kind, "matmul": guarded(matmul), "hbm": guarded(hbm)}
    if len(jax.local_devices()) > 1:
        out["all_reduce"] = guarded(all_reduce)
    return out


def calibration(measured: dict) -> dict:
    """The planner's calibration fields from `measure()`'s dict: rates that were measured only."""
    out = {"device_kind": measured["device_kind"]}
    for name, (field, unit) in FIELDS.items():
        if unit in measured.get(name, {}):
            out[field] = float(f"{measured[name][unit]:.4g}")
    return out


def write(measured: dict, path: str) -> dict:
    """Writes calibration(measured) as JSON to `path`; returns it."""
    fields = calibration(measured)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(fields, f, indent=1)
    return fields
