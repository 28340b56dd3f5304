"""The README's post-training demo, measured: pretrain -> SFT -> DPO, accuracy after each. Prints JSON.

  python -m benchmarks.demos.posttrain_demo [--pretrained runs/demo] [--workdir DIR]

Runs the README's commands as a user would, each in its own process: the pretraining demo
(configs/demo.py; or reuses --pretrained, a finished run of it), then configs/demo_sft.py from
it, then `python -m zaya_jax.preference_pairs` (the SFT model's own wrong answers to the training
questions as DPO pairs), then configs/demo_dpo.py from the SFT run on those pairs, and for each
model `python -m zaya_jax.evaluate_tasks` (exact-match accuracy by greedy generation on the 500
held-out generated questions). Reports each stage's wall time (including compilation and, for
a first run, building the demo data), the accuracies overall and per kind, the pairs made, the
final held-out SFT loss and the DPO metrics (loss, reward margin and preference accuracy, train
and on the validation pairs), and the same for configs/demo_dpo.py with dpo.rpo_alpha=0 (DPO's
loss alone, the ablation), with the load average at start and end: the 2 CPU cores may be
shared with other jobs. The stack (Python, jax) is recorded: the demo corpus, and so every figure,
differs between Python 3.11 and 3.12 (run_all writes posttrain_demo_cpu_py311.json and _py312.json,
and keeps the runs under runs/posttrain_demo_py3NN for grpo_demo.py to start from the same SFT run).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from benchmarks.common import REPO  # noqa: E402

from benchmarks.common import stack  # noqa: E402
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


def train(config: str, workdir: str, init_from: str | None, *overrides: str) -> float:
    start = [f"--config.train.init_from_checkpoint={init_from}"] if init_from else []
    _, wall = run(["zaya_jax.train", "--config", os.path.join(REPO, "configs", config), "--workdir", workdir,
                   "--config.monitor.progress_bar=False", "--config.monitor.tensorboard=False", *start, *overrides])
    return round(wall, 1)


def sft_run(root: str, given: str) -> str:
    """The SFT demo run to start from: `given` (a finished configs/demo_sft.py run), else the
    pretraining and SFT demos trained under `root` now."""
    if given:
        return os.path.abspath(given)
    train("demo.py", os.path.join(root, "demo"), None)
    train("demo_sft.py", os.path.join(root, "demo_sft"), os.path.join(root, "demo"))
    return os.path.join(root, "demo_sft")


def make_pairs(checkpoint: str, output: str) -> dict:
    """The DPO pairs of the README's command -> its summary with the wall time."""
    stdout, wall = run(["zaya_jax.preference_pairs", "--checkpoint", checkpoint, "--output", output])
    summary = json_output(stdout)
    return {k: summary[k] for k in ("questions", "train_accuracy", "wrong_by_kind", "near_miss_for_correct",
                                    "pairs")} | {"wall_s": round(wall, 1)}


def accuracy(workdir: str) -> dict:
    stdout, wall = run(["zaya_jax.evaluate_tasks", "--checkpoint", workdir])
    result = json_output(stdout)
    return {"accuracy": result["accuracy"], "accuracy_by_kind": result["accuracy_by_kind"],
            "questions": result["questions"], "correct": result["correct"], "step": result["step"],
            "wall_s": round(wall, 1)}


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
        runs = {name: os.path.join(root, name) for name in ("demo", "demo_sft", "demo_sft_pairs", "demo_dpo")}
        if args.pretrained:
            runs["demo"], pretrain_wall = os.path.abspath(args.pretrained), None
        else:
            pretrain_wall = train("demo.py", runs["demo"], None)
        before = accuracy(runs["demo"])
        sft_wall = train("demo_sft.py", runs["demo_sft"], runs["demo"])
        after_sft = accuracy(runs["demo_sft"])
        pairs = make_pairs(runs["demo_sft"], runs["demo_sft_pairs"])
        dpo_wall = train("demo_dpo.py", runs["demo_dpo"], runs["demo_sft"],
                         f"--config.data.sources.preference={runs['demo_sft_pairs']}")
        after_dpo = accuracy(runs["demo_dpo"])
        without_rpo = os.path.join(root, "demo_dpo_without_rpo")  # the ablation: DPO's loss alone
        without_rpo_wall = train("demo_dpo.py", without_rpo, runs["demo_sft"], "--config.dpo.rpo_alpha=0.0",
                                 f"--config.data.sources.preference={runs['demo_sft_pairs']}")
        ablation = {"rpo_alpha": 0.0, **accuracy(without_rpo), "wall_s": without_rpo_wall,
                    "dpo_final": final_metrics(without_rpo)}
        sft_metrics, dpo_metrics = final_metrics(runs["demo_sft"]), final_metrics(runs["demo_dpo"])
    print(json.dumps({
        "stack": stack(),
        "accuracy": {"before_sft": before["accuracy"], "after_sft": after_sft["accuracy"],
                     "after_dpo": after_dpo["accuracy"]},
        "accuracy_by_kind": {"before_sft": before["accuracy_by_kind"], "after_sft": after_sft["accuracy_by_kind"],
                             "after_dpo": after_dpo["accuracy_by_kind"]},
        "heldout_questions": before["questions"],
        "steps": {"pretrain": before["step"], "sft": after_sft["step"], "dpo": after_dpo["step"]},
        "wall_s_including_compile": {"pretrain": pretrain_wall, "sft": sft_wall, "pairs": pairs["wall_s"],
                                     "dpo": dpo_wall, "accuracy_each": after_dpo["wall_s"]},
        "dpo_pairs": {k: v for k, v in pairs.items() if k != "wall_s"},
        "dpo_without_rpo": {k: v for k, v in ablation.items() if k not in ("questions", "step")},
        "pretrain_reused": bool(args.pretrained),
        "sft_final": sft_metrics, "dpo_final": dpo_metrics,
        "cpu_count": os.cpu_count(), "machine": "shared with other jobs; timings are indicative",
        "load_average_1m_start_end": [round(load_start, 2), round(os.getloadavg()[0], 2)],
    }, indent=2))


if __name__ == "__main__":
    main()
