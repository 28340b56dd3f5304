"""How configs/demo_grpo.py's settings were chosen: the trainer's held-out accuracy along GRPO runs
of the demo with one setting changed each. Prints JSON and writes
benchmarks/results/grpo_settings_cpu.json.

  python -m benchmarks.demos.grpo_settings [--sft runs/demo_sft] [--workdir runs/grpo_settings]

Each variant is `python -m zaya_jax.train --config configs/demo_grpo.py` from --sft (a finished
run of configs/demo_sft.py) with its overrides, a held-out evaluation every EVAL_EVERY steps
(eval/prompts/exact_answer: greedy exact match on the 500 held-out questions, as evaluate_tasks
scores them) and a train record every 5. A variant whose WORKDIR/<name> already holds an
evaluation at its last step is read, not run again (a run stopped and resumed equals the
uninterrupted one), so --workdir keeps finished variants between calls; `reused` says which.

Reported per variant: its overrides, the held-out accuracy at every evaluation, the sampled
training reward of the first and last records, the summed generation and update seconds of its
records, and the wall time of the runs this call made (the 2 CPU cores may be shared).
"""

from __future__ import annotations

import argparse
import os
import time


from benchmarks.common import print_and_save  # noqa: E402
from benchmarks.demos.posttrain_demo import train  # noqa: E402
from zaya_jax.train.monitor import read_metrics  # noqa: E402

EVAL_EVERY = 20
# name -> (steps, overrides of configs/demo_grpo.py); the demo is AdamW 6e-4, temperature 1, 120 steps
VARIANTS = {
    "demo": (120, ()),
    "learning_rate_3e-4": (120, ("--config.optimizer.learning_rate=3e-4",)),
    "learning_rate_3e-4_temperature_0.7": (120, ("--config.optimizer.learning_rate=3e-4",
                                                 "--config.grpo.temperature=0.7")),
    "learning_rate_3e-4_oversample_prompts_3": (60, ("--config.optimizer.learning_rate=3e-4",
                                                     "--config.grpo.oversample_prompts=3")),
    "demo_240_steps": (240, ()),
}


def finished(workdir: str, steps: int) -> bool:
    path = os.path.join(workdir, "metrics.jsonl")
    return os.path.exists(path) and any(r["step"] == steps for r in read_metrics(path, kind="eval"))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sft", default="runs/demo_sft", help="a finished run of configs/demo_sft.py to start from")
    parser.add_argument("--workdir", default="runs/grpo_settings", help="where the variants' runs go")
    args = parser.parse_args()
    load_start, started = os.getloadavg()[0], time.perf_counter()
    sft, variants = os.path.abspath(args.sft), {}
    for name, (steps, overrides) in VARIANTS.items():
        workdir = os.path.join(os.path.abspath(args.workdir), name)
        reused = finished(workdir, steps)
        wall = None if reused else train("demo_grpo.py", workdir, sft, f"--config.train.steps={steps}",
                                         f"--config.eval.every_steps={EVAL_EVERY}",
                                         "--config.train.log_every_steps=5", "--config.checkpoint.every_steps=0",
                                         *overrides)
        path = os.path.join(workdir, "metrics.jsonl")
        records = [r for r in read_metrics(path) if r["step"] <= steps]
        evals = {r["step"]: r for r in read_metrics(path, kind="eval") if r["step"] <= steps}
        variants[name] = {
            "steps": steps, "overrides": list(overrides), "reused": reused, "wall_s_including_compile": wall,
            "heldout_exact_answer": {str(step): round(record["eval/prompts/exact_answer"], 4)
                                     for step, record in sorted(evals.items())},
            "sampled_reward_first_last": [round(records[0]["reward"], 4), round(records[-1]["reward"], 4)],
            "generation_s": round(sum(r["generation_s"] for r in records), 1),
            "update_s": round(sum(r["update_s"] for r in records), 1)}
    print_and_save({"what": "held-out exact match along GRPO runs of configs/demo_grpo.py, one setting changed each",
                    "sft": args.sft, "variants": variants, "wall_s": round(time.perf_counter() - started, 1),
                    "cpu_count": os.cpu_count(), "machine": "shared with other jobs; timings are indicative",
                    "load_average_1m_start_end": [round(load_start, 2), round(os.getloadavg()[0], 2)]},
                   "grpo_settings_cpu.json")


if __name__ == "__main__":
    main()
