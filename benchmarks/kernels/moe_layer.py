"""MoE layer forward+backward: every dispatch backend against the ideal (one dense expert on
all tokens, i.e. exactly the top-1 FLOPs; timed alternately with each backend, median and
best ratio), with drop rates. `native` is `ragged` on the native CPU grouped matmul
(zaya_jax.native.grouped_matmul). Prints JSON (benchmarks/results/moe_layer_cpu.json).
The process starts with the train CLI's launch defaults (zaya_jax.launch_defaults): the layer is
timed under the heap the trainer runs it with (the backends' weight gradients, E times the
ideal's, are then not faulted in afresh on every call); the ideal shares it.

  python -m benchmarks.kernels.moe_layer [--tokens 2048 --hidden 512 --ffn 1024 --experts 16]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics


HEAP_DEFAULTS = False  # whether this process got the train CLI's heap (set when run as the script)
if __name__ == "__main__":  # as the train CLI starts (the ideal and every backend share the heap)
    from zaya_jax import launch_defaults
    HEAP_DEFAULTS = launch_defaults.apply()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import alternate_times, matmul_peak_gflops  # noqa: E402
from zaya_jax.model import moe_dispatch  # noqa: E402
from zaya_jax.model.kernels import resolve_moe_backend  # noqa: E402
from zaya_jax.model.moe_dispatch import ExpertWeights  # noqa: E402
from zaya_jax.native.grouped_matmul import grouped_matmul  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--ffn", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    t, d, f, e = args.tokens, args.hidden, args.ffn, args.experts
    keys = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(keys[0], (t, d))
    w = ExpertWeights(*(0.02 * jax.random.normal(k, s) for k, s in
                        zip(keys[1:4], [(e, d, f), (e, d, f), (e, f, d)])))
    routings = {
        "uniform": jax.random.randint(keys[4], (t,), 0, e),
        # Zipf-like skew as seen at random init (one expert takes a large share)
        "skewed": jnp.asarray(np.random.default_rng(0).choice(e, size=t, p=(p := 1 / np.arange(1, e + 1) ** 1.2)
                                                              / p.sum()), jnp.int32),
    }
    backends = {
        "dense": moe_dispatch.dense,
        "capacity_1.0": functools.partial(moe_dispatch.capacity, capacity_factor=1.0),
        "capacity_1.25": functools.partial(moe_dispatch.capacity, capacity_factor=1.25),
        "ragged": moe_dispatch.ragged,
        "tiles_32": functools.partial(moe_dispatch.tiles, tile=32),
        "tiles_64": functools.partial(moe_dispatch.tiles, tile=64),
        "tiles_128": functools.partial(moe_dispatch.tiles, tile=128),
        "native": functools.partial(moe_dispatch.ragged, matmul=grouped_matmul),
    }

    def fwd_bwd(fn, expert):
        def loss(x, w):
            return jnp.sum(fn(x, expert, w)[0] ** 2)
        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
        return lambda: jax.block_until_ready(step(x, w))

    one = ExpertWeights(w.gate[:1], w.up[:1], w.down[:1])
    ideal_step = jax.jit(jax.value_and_grad(lambda x, w: jnp.sum(moe_dispatch._swiglu(
        x[None], w.gate, w.up, w.down, "ecd,edi->eci") ** 2), argnums=(0, 1)))
    ideal = lambda: jax.block_until_ready(ideal_step(x, one))  # noqa: E731
    gflop = 18 * t * d * f / 1e9
    peak = matmul_peak_gflops()
    result = {"platform": jax.default_backend(), "tokens": t, "hidden": d, "ffn": f, "experts": e,
              "auto_backend": resolve_moe_backend("auto"), "heap_launch_defaults": HEAP_DEFAULTS,
              "matmul_peak_gflops": round(peak, 1), "expert_gflop": round(gflop, 3),
              "load_average_1min_start": os.getloadavg()[0],
              "routings": {}}
    for rname, expert in routings.items():
        rows = {}
        for bname, fn in backends.items():
            ideal_times, times = alternate_times(ideal, fwd_bwd(fn, expert), args.repeats)
            dropped = int(jax.jit(fn)(x, expert, w)[1])
            rows[bname] = {"seconds": round(statistics.median(times), 5),
                           "ideal_s": round(statistics.median(ideal_times), 5),
                           "x_ideal": round(statistics.median(times) / statistics.median(ideal_times), 3),
                           "x_ideal_best": round(min(times) / min(ideal_times), 3),
                           "drop_rate": round(dropped / t, 4),
                           "fraction_of_peak": round(gflop / statistics.median(times) / peak, 3),
                           "ideal_fraction_of_peak": round(gflop / statistics.median(ideal_times) / peak, 3)}
        result["routings"][rname] = rows
    result["load_average_1min_end"] = os.getloadavg()[0]
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
