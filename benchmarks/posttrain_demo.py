"""The README's post-training demo, measured: pretrain -> SFT -> DPO, accuracy after each. Prints JSON.

  python benchmarks/posttrain_demo.py [--pretrained runs/demo] [--workdir DIR]

Runs the README's commands as a user would, each in its own process: the pretraining demo
(configs/demo.py; or reuses --pretrained, a finished run of it), then configs/demo_sft.py from
it, then configs/demo_dpo.py from the SFT run, and after each stage
`python -m zaya_jax.evaluate_tasks` (exact-match accuracy by greedy generation on the 500
held-out generated questions). Reports each stage's wall time (including compilation and, for
a first run, building the demo data), the accuracies overall and per kind, the final held-out
SFT loss and the DPO metrics (loss, reward margin and preference accuracy, train and held-out),
with the load average at start and end: the 2 CPU cores may be shared with other jobs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.run_all import json_output  # noqa: E402
from zaya_jax.train.monitor import read_metrics  # noqa: E402


def run(args: list[str]) -> tuple[str, float]:
    """Runs `python -m ...args` in the repository -> (stdout, wall seconds); fails loudly."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": REPO})
    if done.returncode:
        raise RuntimeError(f"{' '.join(args)} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return done.stdout, time.perf_counter() - start


def train(config: str, workdir: str, init_from: str | None) -> float:
    overrides = [f"--config.train.init_from_checkpoint={init_from}"] if init_from else []
    _, wall = run(["zaya_jax.train", "--config", os.path.join(REPO, "configs", config), "--workdir", workdir,
                   "--config.monitor.progress_bar=False", "--config.monitor.tensorboard=False", *overrides])
    return round(wall, 1)


def accuracy(workdir: str) -> dict:
    stdout, wall = run(["zaya_jax.evaluate_tasks", "--checkpoint", workdir])
    result = json_output(stdout)
    return {"accuracy": result["accuracy"], "accuracy_by_kind": result["accuracy_by_kind"],
            "questions": result["questions"], "step": result["step"], "wall_s": round(wall, 1)}


def final_metrics(workdir: str) -> dict:
    """The last logged training record and the last evaluation, rounded."""
    path = os.path.join(workdir, "metrics.jsonl")
    last_train, last_eval = read_metrics(path)[-1], read_metrics(path, kind="eval")[-1]
    keep = lambda record: {k: round(v, 4) for k, v in record.items() if isinstance(v, float)}
    return {"train": {"step": last_train["step"], **keep(last_train)},
            "eval": {"step": last_eval["step"], **keep(last_eval)}}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pretrained", default="", help="a finished run of configs/demo.py to start from "
                                                          "(default: train one)")
    parser.add_argument("--workdir", default="", help="where the runs go (default: a temporary dir)")
    args = parser.parse_args()
    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        root = os.path.abspath(args.workdir or tmp)
        runs = {name: os.path.join(root, name) for name in ("demo", "demo_sft", "demo_dpo")}
        if args.pretrained:
            runs["demo"], pretrain_wall = os.path.abspath(args.pretrained), None
        else:
            pretrain_wall = train("demo.py", runs["demo"], None)
        before = accuracy(runs["demo"])
        sft_wall = train("demo_sft.py", runs["demo_sft"], runs["demo"])
        after_sft = accuracy(runs["demo_sft"])
        dpo_wall = train("demo_dpo.py", runs["demo_dpo"], runs["demo_sft"])
        after_dpo = accuracy(runs["demo_dpo"])
        sft_metrics, dpo_metrics = final_metrics(runs["demo_sft"]), final_metrics(runs["demo_dpo"])
    print(json.dumps({
        "accuracy": {"before_sft": before["accuracy"], "after_sft": after_sft["accuracy"],
                     "after_dpo": after_dpo["accuracy"]},
        "accuracy_by_kind": {"before_sft": before["accuracy_by_kind"], "after_sft": after_sft["accuracy_by_kind"],
                             "after_dpo": after_dpo["accuracy_by_kind"]},
        "heldout_questions": before["questions"],
        "steps": {"pretrain": before["step"], "sft": after_sft["step"], "dpo": after_dpo["step"]},
        "wall_s_including_compile": {"pretrain": pretrain_wall, "sft": sft_wall, "dpo": dpo_wall,
                                     "accuracy_each": after_dpo["wall_s"]},
        "pretrain_reused": bool(args.pretrained),
        "sft_final": sft_metrics, "dpo_final": dpo_metrics,
        "cpu_count": os.cpu_count(), "machine": "shared with other jobs; timings are indicative",
        "load_average_1m_start_end": [round(load_start, 2), round(os.getloadavg()[0], 2)],
    }, indent=2))


if __name__ == "__main__":
    main()
