"""The README's GRPO demo, measured over seeds: configs/demo_grpo.py from the SFT demo's run,
held-out accuracy before and after. Prints JSON.

  python -m benchmarks.demos.grpo_demo [--sft runs/demo_sft] [--workdir DIR] [--seeds 0,1,2]

Runs the README's commands as a user would, each in its own process: the pretraining and SFT
demos (configs/demo.py, configs/demo_sft.py; or reuses --sft, a finished run of the latter), then
configs/demo_grpo.py from it once per seed (`--config.train.seed`: the prompts' order and the
sampled completions), and `python -m zaya_jax.evaluate_tasks` (exact match by greedy generation on
the 500 held-out generated questions, none of which GRPO samples) on the SFT checkpoint and each
GRPO checkpoint. Per seed: the accuracies overall and per kind, the paired comparison on the same
questions (how many GRPO answers right that SFT got wrong, and the reverse, with the exact
two-sided sign test's p-value of that split: the chance of one at least as lopsided if GRPO
changed nothing but noise), the wall time with the load average at its start and end (the 2 CPU
cores may be shared with other jobs), the trainer's own held-out evaluations during the run
(eval/prompts/exact_answer), the first and last logged generation statistics (reward,
reward_std, frac_reward_zero_std, completion lengths, KL, clip ratio) and how the run's time split
between generation and update. Over the seeds: the gain's mean, sample standard deviation, min and
max in points. The stack (Python, jax) is recorded: the demo corpus, and so every figure, differs
between Python 3.11 and 3.12 (run_all writes grpo_demo_cpu_py311.json and _py312.json).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile


from benchmarks.common import stack  # noqa: E402
from benchmarks.demos.posttrain_demo import accuracy, sft_run, train  # noqa: E402
from zaya_jax.train.monitor import read_metrics  # noqa: E402

LOGGED = ("reward", "reward_std", "frac_reward_zero_std", "completion_length", "clipped_completion_ratio", "kl",
          "clip_ratio", "loss", "grad_norm")


def paired(before: str, after: str) -> dict:
    """Two checkpoints' per-question results ("1" right, "0" wrong, same questions) -> the questions
    only the second answers right (gained), only the first (lost), and the exact two-sided sign
    test's p-value of that split (binomial, n = gained + lost, p = 1/2)."""
    gained = sum(b == "0" and a == "1" for b, a in zip(before, after, strict=True))
    lost = sum(b == "1" and a == "0" for b, a in zip(before, after, strict=True))
    n, k = gained + lost, min(gained, lost)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n if n else 1.0
    return {"gained": gained, "lost": lost, "sign_test_p": min(1.0, 2 * tail)}


def one_seed(sft: str, before: dict, workdir: str, seed: int) -> dict:
    """configs/demo_grpo.py from `sft` with train.seed = `seed`, scored against `before` (the SFT
    checkpoint's evaluate_tasks result)."""
    load_start = os.getloadavg()[0]
    wall = train("demo_grpo.py", workdir, sft, f"--config.train.seed={seed}")
    load_end = os.getloadavg()[0]
    after = accuracy(workdir)
    path = os.path.join(workdir, "metrics.jsonl")
    records, evals = read_metrics(path), read_metrics(path, kind="eval")
    keep = lambda record: {k: round(record[k], 4) for k in LOGGED if k in record}  # noqa: E731
    generation = sum(r["generation_s"] for r in records)
    update = sum(r["update_s"] for r in records)
    return {
        "seed": seed, "accuracy": after["accuracy"], "accuracy_by_kind": after["accuracy_by_kind"],
        "gain_points": round(100 * (after["accuracy"] - before["accuracy"]), 1),
        "paired": paired(before["correct"], after["correct"]), "steps": after["step"],
        "wall_s_including_compile": wall, "load_average_1m_start_end": [round(load_start, 2), round(load_end, 2)],
        "trainer_heldout_exact_answer": {str(r["step"]): round(r["eval/prompts/exact_answer"], 4) for r in evals},
        "first_logged": {"step": records[0]["step"], **keep(records[0])},
        "last_logged": {"step": records[-1]["step"], **keep(records[-1])},
        "generation_s": round(generation, 1), "update_s": round(update, 1),
        "generation_share": round(generation / (generation + update), 3)}


def spread(values: list[float]) -> dict:
    """Mean, sample standard deviation (0 for one value), min and max, rounded to 0.1."""
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return {"mean": round(statistics.fmean(values), 1), "std": round(std, 1), "min": min(values), "max": max(values),
            "n": len(values)}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sft", default="", help="a finished run of configs/demo_sft.py to start from "
                                                  "(default: train the pretraining and SFT demos)")
    parser.add_argument("--workdir", default="", help="where the runs go (default: a temporary dir)")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated train.seed values, one GRPO run each")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",") if s]
    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        root = os.path.abspath(args.workdir or tmp)
        sft = sft_run(root, args.sft)
        before = accuracy(sft)
        runs = [one_seed(sft, before, os.path.join(root, f"demo_grpo_seed{seed}"), seed) for seed in seeds]
    print(json.dumps({
        "stack": stack(),
        "sft": {"accuracy": before["accuracy"], "accuracy_by_kind": before["accuracy_by_kind"], "steps": before["step"]},
        "heldout_questions": before["questions"],
        "gain_points": spread([r["gain_points"] for r in runs]),
        "accuracy_after_grpo": spread([round(100 * r["accuracy"], 1) for r in runs]),
        "wall_s_including_compile": spread([r["wall_s_including_compile"] for r in runs]),
        "seeds": runs,
        "sft_reused": bool(args.sft),
        "cpu_count": os.cpu_count(), "machine": "shared with other jobs; timings are indicative",
        "load_average_1m_start_end": [round(load_start, 2), round(os.getloadavg()[0], 2)],
    }, indent=2))


if __name__ == "__main__":
    main()
