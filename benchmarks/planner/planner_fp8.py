"""The planner's prediction for ZAYA1-base trained with FP8 matmuls (model.matmul_precision=fp8)
against bf16, on 1,024 MI300X and on 1,024 H200. Prints JSON; writes
benchmarks/results/planner_fp8_predictions.json. Paper numbers (zaya_jax.planner.step_time: the
CCA projections' and experts' FLOPs at the profile's FP8 rate, assumed the same fraction of the
FP8 peak as bf16 GEMMs reach of theirs), no timing of this machine or of a GPU.

  python -m benchmarks.planner.planner_fp8

Cases: configs/zaya1_base.py on its own mesh per phase (as benchmarks/planner/planner_predictions.py's
shipped-config cases), each hardware in bf16 and in FP8, and the FP8 step's speed-up per phase.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from benchmarks.common import print_and_save  # noqa: E402
from benchmarks.planner.planner_predictions import DEVICES, phase_cases  # noqa: E402
from zaya_jax.config_files import load_config_file, model_config  # noqa: E402
from zaya_jax.hardware import PROFILES  # noqa: E402

KEEP = ("phase", "mesh", "fits", "step_s", "compute_s", "memory_s", "blocking_collectives_s", "tokens_per_s", "mfu",
        "bound_by", "days")


def main():
    config = load_config_file("configs/zaya1_base.py")
    cfg = model_config(config)
    result = {"what": "ZAYA1-base on 1,024 GPUs, shipped config's mesh per phase: bf16 vs model.matmul_precision=fp8 "
                      "(planner paper numbers, no GPU run)", "devices": DEVICES}
    for name in ("mi300x", "h200"):
        hw = PROFILES[name]
        cases = {precision: [{k: p[k] for k in KEEP if k in p} for p in
                             phase_cases(cfg.replace(matmul_precision=precision), config, None, hw)]
                 for precision in ("default", "fp8")}
        result[name] = {"bf16_matmul_tflops": hw.matmul_tflops, "fp8_matmul_tflops": hw.fp8_matmul_tflops,
                        "matmul_efficiency": hw.efficiency.matmul, "bf16": cases["default"], "fp8": cases["fp8"],
                        "fp8_speedup_per_phase": [b["step_s"] / f["step_s"] for b, f in
                                                  zip(cases["default"], cases["fp8"])]}
    print_and_save(result, "planner_fp8_predictions.json")


if __name__ == "__main__":
    main()
