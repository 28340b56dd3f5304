"""XLA:CPU compiler flags on the bench_small train step: the step compiled with each flag set
(`Lowered.compile(compiler_options=...)`, so all variants share one process) and timed in
turn, round after round. Prints JSON (benchmarks/results/xla_cpu_flags_cpu.json).

  python -m benchmarks.ci.xla_cpu_flags [--repeats 5]

A flag would become a launch default (zaya_jax.launch_defaults) only if its median ratio to the
default compile stood clear of the round-to-round spread; `ratio_vs_default` < 1 is faster.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics


if __name__ == "__main__":  # as the train CLI starts
    from zaya_jax import launch_defaults
    launch_defaults.apply()

import jax  # noqa: E402

from benchmarks.common import wall_time  # noqa: E402
from benchmarks.training.hf_pair import bench_small  # noqa: E402
from benchmarks.training.train_step import jax_step_fn, repeated_step  # noqa: E402
from zaya_jax.model.zaya import ZayaLM  # noqa: E402
from zaya_jax.train.optimizer import make_optimizer  # noqa: E402
from zaya_jax.train.settings import settings_from_config  # noqa: E402

# flags of jax 0.10.2's XLA:CPU (they exist in its libjax_common.so) that can change step time
VARIANTS = {
    "default": {},
    "prefer_vector_width_512": {"xla_cpu_prefer_vector_width": 512},
    "no_concurrency_optimized_scheduler": {"xla_cpu_enable_concurrency_optimized_scheduler": False},
    "copy_insertion_region_analysis": {"xla_cpu_copy_insertion_use_region_analysis": True},
    "fast_math (changes numerics)": {"xla_cpu_enable_fast_math": True},
}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    load_start = os.getloadavg()[0]
    from flax import nnx
    config, cfg = bench_small()
    settings = settings_from_config(config)
    model = ZayaLM(cfg, rngs=nnx.Rngs(0))
    adamw = make_optimizer(settings.optimizer, settings.train.steps)
    b, s = settings.train.global_batch_size, settings.train.seq_len
    ids = jax.random.randint(jax.random.key(0), (b, s + 1), 3, cfg.vocab_size)
    batch = {"inputs": ids[:, :-1], "targets": ids[:, 1:], "segment_ids": jax.numpy.ones((b, s), "int32"),
             "positions": jax.numpy.broadcast_to(jax.numpy.arange(s, dtype="int32"), (b, s)),
             "loss_mask": jax.numpy.ones((b, s), "float32")}
    steps = {}
    for name, options in VARIANTS.items():
        state, step = jax_step_fn(model, settings, adamw)
        steps[name] = repeated_step(state, step.lower(state, batch).compile(compiler_options=options), batch)
        steps[name]()  # warm up
    times = {name: [] for name in VARIANTS}
    for _ in range(args.repeats):
        for name, run in steps.items():
            times[name].append(wall_time(run))
    rows = {}
    for name in VARIANTS:
        ratios = [t / d for t, d in zip(times[name], times["default"])]
        rows[name] = {"flags": VARIANTS[name], "s_per_step": round(statistics.median(times[name]), 4),
                      "ratio_vs_default": round(statistics.median(ratios), 3),
                      "ratio_range": [round(min(ratios), 3), round(max(ratios), 3)]}
    print(json.dumps({
        "config": "bench_small", "platform": jax.default_backend(), "jax": jax.__version__,
        "repeats": args.repeats, "variants": rows, "set_by_default": [],
        "cpu_count": os.cpu_count(), "machine": "shared with other jobs: see the load average",
        "load_average_1min_start_end": [round(load_start, 2), round(os.getloadavg()[0], 2)],
    }, indent=2))


if __name__ == "__main__":
    main()
