"""The planner's serving prediction for ZAYA1-8B on one H200 and one MI300X at a 4,096-token
context (zaya_jax.planner.serve_plan, `python -m zaya_jax.planner --serve`). Prints JSON; writes
benchmarks/results/serve_predictions.json. Paper numbers from the hardware profiles (a roofline
on their achieved HBM and matmul rates), no timing of this machine or of a GPU.

  python -m benchmarks.planner.serve_predictions

Per GPU and weight format (bf16, int8 and int4 weight-only with group-64 scales): the weight
bytes, the concurrent requests that fit (10% of memory reserved), and the decode step at 1, 2,
4, ... requests up to that many; `summary` holds the figures docs/parallel.md quotes (batches 1,
8, 32 and the most that fit).
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from benchmarks.common import print_and_save  # noqa: E402
from zaya_jax.config_files import load_config_file, model_config  # noqa: E402
from zaya_jax.hardware import PROFILES  # noqa: E402
from zaya_jax.planner.serve_plan import plan_serving  # noqa: E402

CONFIG = "configs/zaya1_8b.py"
CONTEXT = 4096
HARDWARE = ("h200", "mi300x")
QUOTED_BATCHES = (1, 8, 32)


def summarise(plan: dict) -> dict:
    """Per weight format: GB of weights, slots, and tokens/s at QUOTED_BATCHES and at the slots."""
    out = {}
    for name, f in plan["formats"].items():
        by_batch = {d["batch"]: d["tokens_per_s"] for d in f["decode"]}
        out[name] = {"weights_gb": f["weight_bytes"]["total"] / 1e9, "slots": f["slots"],
                     "tokens_per_s": {str(b): by_batch[b] for b in (*QUOTED_BATCHES, f["slots"])}}
    return out


def main():
    cfg = model_config(load_config_file(CONFIG))
    plans = {hw: plan_serving(cfg, PROFILES[hw], CONTEXT, PROFILES[hw].memory_gb) for hw in HARDWARE}
    print_and_save({"what": f"ZAYA1-8B ({CONFIG}) served on one GPU at {CONTEXT} tokens per request, predicted by "
                            "the planner (paper numbers, no GPU run)",
                    "config": CONFIG, "context": CONTEXT,
                    "summary": {hw: summarise(plan) for hw, plan in plans.items()}, "plans": plans},
                   "serve_predictions.json")


if __name__ == "__main__":
    main()
