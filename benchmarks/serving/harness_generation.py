"""lm-evaluation-harness generation through the serving engine (`ZayaHarnessLM(slots=N)`, the
harness CLI's `--slots N`) against its static batches (`batch_size=N`), on a trained checkpoint and
a bundled generate_until task, timed in one process. Prints JSON.

  python -m benchmarks.serving.harness_generation --checkpoint runs/posttrain_demo_py311/demo
      [--slots 8] [--per-kind 24] [--max-gen-toks 128] [--repeats 3]

The model: the post-training demo's pretrained run (a base model, as lm-eval's few-shot generation
tasks usually score: it writes on until a stop sequence, so its completions end at scattered
lengths). The task: zaya_demo_questions (the demo's held-out instruction questions,
"User: ...\nAssistant:" prompts, stop sequence "\n"), greedy, --per-kind questions of each kind,
max_gen_toks set to --max-gen-toks (gen_kwargs). A static batch decodes until each of its rows has
emitted eos or max_gen_toks tokens (the stop sequence cuts the texts afterwards); the engine ends
a request at its first stop sequence too, and its row takes the next. Each side runs
`lm_eval.simple_evaluate` once untimed (compiling) and then --repeats times (request building and
scoring included, as a user waits for them): every time, and the median. Both sides' exact match
and whether every response is equal (greedy: it must be) are reported; the ratio is engine /
static medians (below 1: the engine is faster). The load average is recorded at the start and end.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import lm_eval  # noqa: E402

from benchmarks.common import stack, wall_time  # noqa: E402
from zaya_jax.harness.model import ZayaHarnessLM  # noqa: E402
from zaya_jax.harness.tasks import task_manager  # noqa: E402

TASK = "zaya_demo_questions"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint", required=True, help="a trained run, e.g. runs/posttrain_demo_py311/demo")
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--per-kind", type=int, default=24)
    parser.add_argument("--max-gen-toks", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    load_start = os.getloadavg()[0]
    manager = task_manager(metadata={"per_kind": args.per_kind, "cache_dir": tempfile.mkdtemp()})
    sides = {"static": ZayaHarnessLM(checkpoint=args.checkpoint, batch_size=args.slots),
             "engine": ZayaHarnessLM(checkpoint=args.checkpoint, batch_size=args.slots, slots=args.slots)}
    out = {}

    def evaluate(lm) -> dict:
        return lm_eval.simple_evaluate(model=lm, tasks=[TASK], task_manager=manager, log_samples=True,
                                       gen_kwargs=f"max_gen_toks={args.max_gen_toks}", bootstrap_iters=0)
    for name, lm in sides.items():
        result = evaluate(lm)
        times = [round(wall_time(lambda lm=lm: evaluate(lm)), 3) for _ in range(args.repeats)]
        out[name] = {"s": round(statistics.median(times), 3), "times_s": times,
                     "exact_match": result["results"][TASK]["exact_match,none"],
                     "responses": [s["resps"][0][0] for s in sorted(result["samples"][TASK], key=lambda s: s["doc_id"])]}
    responses = out["static"].pop("responses")
    equal = out["engine"].pop("responses") == responses
    print(json.dumps({
        "checkpoint": args.checkpoint, **stack(), "task": TASK, "requests": len(responses), "slots": args.slots,
        "batch_size": args.slots, "max_gen_toks": args.max_gen_toks, "repeats": args.repeats, **out,
        "responses_equal": equal,
        "response_characters_mean": round(sum(map(len, responses)) / len(responses), 1),
        "engine_vs_static": round(out["engine"]["s"] / out["static"]["s"], 3),
        "load_average_1min_start_end": [round(load_start, 2), round(os.getloadavg()[0], 2)],
    }, indent=2))


if __name__ == "__main__":
    main()
