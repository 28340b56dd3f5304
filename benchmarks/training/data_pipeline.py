"""Data pipeline throughput on the demo corpus: tokens/s with 0, 1 and 2 Grain workers.

    python -m benchmarks.training.data_pipeline [--batches 300] [--seq-len 256] [--batch 8]

One phase (the demo's mixed phase) at L=256, global batch 8, one process. For each worker count
it reports the start-up time (building the pipeline and its first batch, which includes
starting worker processes) and the steady rate over --batches batches: tokens/s counts every
position (B*L per batch, what the training step consumes), target_tokens_per_s only positions
with loss_mask 1, and fill their ratio. Prints one JSON object.
"""

import argparse
import json
import os
import time

from absl import flags  # noqa: E402

if not flags.FLAGS.is_parsed():  # Grain workers read absl flags (grain 0.2.18 pitfall)
    flags.FLAGS.mark_as_parsed()

from zaya_jax.data import build_pipeline, demo_data_config  # noqa: E402


def measure(config, workers: int, batches: int) -> dict:
    config.worker_count = workers
    start = time.perf_counter()
    pipeline = build_pipeline(config)
    try:
        next(pipeline)
        startup = time.perf_counter() - start
        start, real = time.perf_counter(), 0.0
        for _ in range(batches):
            real += float(next(pipeline)["loss_mask"].sum())
        elapsed = time.perf_counter() - start
    finally:
        pipeline.close()
    phase = pipeline.phase
    tokens = batches * phase.global_batch_size * phase.seq_len
    return {"workers": workers, "startup_s": round(startup, 3), "tokens_per_s": round(tokens / elapsed),
            "target_tokens_per_s": round(real / elapsed), "fill": round(real / tokens, 4),
            "batches_per_s": round(batches / elapsed, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=300)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--cache-dir", default="", help="demo corpus cache (default: the usual one)")
    args = parser.parse_args()

    config = demo_data_config()
    config.demo.cache_dir = args.cache_dir
    mixed = config.phases[2]
    mixed.seq_len, mixed.global_batch_size = args.seq_len, args.batch
    mixed.token_budget = (args.batches + 1) * args.batch * args.seq_len
    config.phases = (mixed,)
    build_pipeline(config).close()  # builds the demo corpus now if needed, outside the timings
    results = [measure(config, workers, args.batches) for workers in (0, 1, 2)]
    print(json.dumps({"benchmark": "data_pipeline", "seq_len": args.seq_len, "global_batch": args.batch,
                      "batches": args.batches, "cpus": os.cpu_count(), "phase_weights": dict(mixed.weights),
                      "packing_bins": config.packing_bins, "prefetch_buffer_size": config.prefetch_buffer_size,
                      "results": results}, indent=1))


if __name__ == "__main__":
    main()
