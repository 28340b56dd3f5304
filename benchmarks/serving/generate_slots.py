"""Where `zaya_jax.engine.generate(..., slots=N)` (the serving engine's continuous batching) helps: an
offline batch of many prompts whose completions stop at different lengths, against the static
loop run as evaluate_tasks runs it (batches of N prompts, each decoding until its last row stops),
on the same prompts, weights and stop ids, timed in one process. Prints JSON.

  python -m benchmarks.serving.generate_slots [--config configs/demo.py] [--prompts 48] [--slots 8]
      [--max-new 48] [--stop-fraction 0.0625] [--seeds 0,1,2] [--repeats 2]

Weights: a random init of the config's model (the work does not depend on the values). Each seed
draws its prompts (lengths 8 to 64, uniform) and a --stop-fraction of the vocabulary as stop ids
(besides eos); the completions are sampled at temperature 1, so a random model's tokens hit a stop
id at scattered steps (about 1 / stop-fraction on average), which the results list per side (mean
and max tokens per completion: the two sides draw other random streams, so their lengths differ
by chance; greedy tokens are equal, tests/test_generate_slots.py). Each side runs once untimed
(compiling) and then --repeats times; the median is its time. The ratio is engine / static (below
1: the engine is faster): mean and spread over the seeds. The load average is recorded at the
start and end.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

from benchmarks.common import REPO  # noqa: E402

import numpy as np  # noqa: E402

from benchmarks.common import median_time, stack  # noqa: E402
from zaya_jax.config_files import load_config_file, model_config  # noqa: E402
from zaya_jax.engine import generate  # noqa: E402
from zaya_jax.model.build import create_model  # noqa: E402


def static_batches(model, prompts, max_new: int, slots: int, stops, seed: int) -> np.ndarray:
    """The static loop in batches of `slots` prompts (a short last batch filled with its last row,
    as evaluation.answering.generate_completions does, so every batch reuses one compiled program)."""
    out = []
    for start in range(0, len(prompts), slots):
        batch = prompts[start:start + slots]
        filled = batch + [batch[-1]] * (slots - len(batch))
        out.append(generate(model, filled, max_new, temperature=1.0, seed=seed + start, stop_ids=stops)[:len(batch)])
    return np.concatenate(out)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default=os.path.join(REPO, "configs", "demo.py"))
    parser.add_argument("--prompts", type=int, default=48)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--max-new", type=int, default=48)
    parser.add_argument("--stop-fraction", type=float, default=0.0625)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    load_start = os.getloadavg()[0]
    cfg = model_config(load_config_file(args.config))
    model = create_model(cfg, seed=0)
    runs = []
    for seed in map(int, args.seeds.split(",")):
        rng = np.random.default_rng(seed)
        prompts = [rng.integers(3, cfg.vocab_size, rng.integers(8, 65)).tolist() for _ in range(args.prompts)]
        count = max(1, round(args.stop_fraction * cfg.vocab_size))
        stops = tuple(int(t) for t in rng.choice(np.arange(3, cfg.vocab_size), count, replace=False))

        def static() -> np.ndarray:
            return static_batches(model, prompts, args.max_new, args.slots, stops, seed)

        def engine() -> np.ndarray:
            return generate(model, prompts, args.max_new, temperature=1.0, seed=seed, stop_ids=stops,
                            slots=args.slots)

        row = {"seed": seed}
        for name, side in (("static", static), ("engine", engine)):
            ended = [next((i + 1 for i, t in enumerate(r) if t in stops or t == cfg.eos_token_id), args.max_new)
                     for r in side().tolist()]
            row.update({f"{name}_s": round(median_time(side, args.repeats), 3),
                        f"{name}_completion_tokens_mean": round(statistics.mean(ended), 1),
                        f"{name}_completion_tokens_max": max(ended)})
        row["engine_vs_static"] = round(row["engine_s"] / row["static_s"], 3)
        runs.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    ratios = [r["engine_vs_static"] for r in runs]
    print(json.dumps({
        "config": os.path.basename(args.config), **stack(), "prompts": args.prompts, "slots": args.slots,
        "max_new_tokens": args.max_new, "stop_fraction": args.stop_fraction, "temperature": 1.0, "runs": runs,
        "engine_vs_static_mean": round(statistics.mean(ratios), 3),
        "engine_vs_static_stdev": round(statistics.stdev(ratios), 3) if len(ratios) > 1 else 0.0,
        "load_average_1min_start_end": [round(load_start, 2), round(os.getloadavg()[0], 2)],
    }, indent=2))


if __name__ == "__main__":
    main()
