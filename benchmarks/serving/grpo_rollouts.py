"""The GRPO demo's sampling: the serving engine (grpo_rollout.sample_groups, what GRPO samples
with) against static batching (zaya_jax.infer.generate_static, what GRPO sampled with before), on the same
prompts, G, weights and seed, timed in one process. Prints JSON.

  python -m benchmarks.serving.grpo_rollouts [--checkpoint runs/demo_sft] [--slots 64,512] [--repeats 2]

Weights: the checkpoint's (default the SFT demo's run, configs/demo_grpo.py's starting point), as
the trainer's policy (grpo_batches: RoPE base 1e5, dropless MoE). Work: configs/demo_grpo.py's
generation 0 at train.seed 0: its 64 prompts x 8 completions (512 rows) of up to 8 tokens,
temperature 1, stops at eos and the template's end of turn, the prompts' column 48. Both on the
trainer's mesh (make_mesh(mesh section): one device on a CPU without fake devices).

- static: one generate_static call over the 512 rows (the rows padded to its prompt bucket, decoding
  until every row has stopped or 8 tokens), as GRPO called it.
- engine: grpo_rollout.sample_groups on an engine of S slots (--slots; a slot count the trainer
  would clamp to 512 rows is run as 512), built and warmed by one call first, then its weights set
  in place before each timed call (as each generation does).

Each is called once untimed (compiling) and then --repeats times; the median of those is its
time (and the first call's time, compile included, is kept). The engine's rows are checked to be
each row's own sample (its tokens equal across slot counts); the static batch samples other
streams (one key for the batch), so only the completion lengths' means are compared. The ratio is
engine / static (below 1: the engine is faster). The load average is recorded at the start and end.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from benchmarks.common import REPO  # noqa: E402

import numpy as np  # noqa: E402

from benchmarks.common import stack  # noqa: E402
from zaya_jax.config_files import load_config_file  # noqa: E402
from zaya_jax.data.sources import tokenizer_path  # noqa: E402
from zaya_jax.infer.static_loop import generate_static, stop_tokens  # noqa: E402
from zaya_jax.parallel.mesh import make_mesh  # noqa: E402
from zaya_jax.checkpoints.orbax_checkpoint import load_checkpoint_model  # noqa: E402
from zaya_jax.train.grpo_batches import open_grpo_data  # noqa: E402
from zaya_jax.train.grpo_rollout import rollout_engine, sample_groups  # noqa: E402
from zaya_jax.train.settings import settings_from_config  # noqa: E402


def timed(fn, repeats: int) -> tuple[object, float, float]:
    """-> (the last result, the first call's seconds (compiling), the median of `repeats` more)."""
    start = time.perf_counter()
    result = fn()
    first = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return result, round(first, 2), round(statistics.median(times), 3)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default="runs/demo_sft", help="the policy's weights (a run or checkpoint)")
    parser.add_argument("--slots", default="64,512", help="comma-separated engine slot counts")
    parser.add_argument("--repeats", type=int, default=2, help="timed calls of each after the first")
    args = parser.parse_args()
    load_start = os.getloadavg()[0]
    config = load_config_file(os.path.join(REPO, "configs", "demo_grpo.py"))
    settings = settings_from_config(config)
    g = settings.grpo
    data = open_grpo_data(config, settings, tokenizer_path(config.data))
    model, step = load_checkpoint_model(args.checkpoint, None, rope_theta=settings.model.rope_theta, moe_backend="auto")
    mesh = make_mesh(settings.mesh.sizes)
    prompts = [data._prompts.ids[i] for i in data.prompt_indices(0)]
    rows = [list(p) for p in prompts for _ in range(g.num_generations)]
    seed, stop_ids = data.sample_seed(0), data._stop_ids
    options = dict(temperature=g.temperature, seed=seed, stop_ids=stop_ids)
    stops = set(stop_tokens(settings.model.eos_token_id, stop_ids))

    def static():
        return np.asarray(generate_static(model, rows, g.max_completion_length, mesh=mesh, **options))

    tokens, static_first, static_s = timed(static, args.repeats)
    static_lengths = [next((t + 1 for t, x in enumerate(r) if x in stops), len(r)) for r in tokens.tolist()]
    result = {"static": {"first_call_s": static_first, "median_s": static_s,
                         "mean_completion_length": round(float(np.mean(static_lengths)), 3)}}
    completions = None
    for slots in [min(int(s), len(rows)) for s in args.slots.split(",") if s]:
        engine = rollout_engine(model, slots, g.max_prompt_length, g.max_completion_length, mesh)

        def sample():
            engine.set_weights(model)
            return sample_groups(engine, prompts, g.num_generations, g.max_completion_length,
                                 width=g.max_prompt_length, **options)

        rollout, first, median = timed(sample, args.repeats)
        if completions is not None and not (rollout.completions == completions).all():
            raise AssertionError(f"the engine on {slots} slots sampled other tokens than on the first slot count")
        completions = rollout.completions
        result[f"engine_{slots}_slots"] = {"first_call_s": first, "median_s": median,
                                           "ratio_to_static": round(median / static_s, 3),
                                           "mean_completion_length": round(float(rollout.lengths.mean()), 3)}
    print(json.dumps({
        "stack": stack(), "checkpoint_step": step,
        "work": {"prompts": len(prompts), "group_size": g.num_generations, "rows": len(rows),
                 "max_new_tokens": g.max_completion_length, "prompt_width": g.max_prompt_length,
                 "temperature": g.temperature, "mesh": dict(mesh.shape)},
        "repeats": args.repeats, **result,
        "cpu_count": os.cpu_count(), "machine": "shared with other jobs; timings are indicative",
        "load_average_1m_start_end": [round(load_start, 2), round(os.getloadavg()[0], 2)],
    }, indent=2))


if __name__ == "__main__":
    main()
