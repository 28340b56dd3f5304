"""The planner's predictions for ZAYA1-base on 1,024 MI300X, set beside the seed run's report.
Prints JSON; writes benchmarks/results/planner_predictions.json. Nothing runs on a GPU: these are
the planner's paper numbers (zaya_jax.planner.step_time), no timing of this machine.

  python -m benchmarks.planner.planner_predictions

The seed run's figure: AMD's announcement of it says the cluster "delivered over 750 PFLOPs of Max
Achievable FLOPS in training performance". AMD's Max-Achievable FLOPs (MAF) is the rate a tuned
dense bf16 GEMM sustains, 708 TFLOP/s per MI300X (zaya_jax.hardware.MAF_SOURCE): 1,024 of them
make 725 PFLOP/s. So the 750 is the cluster's GEMM ceiling, not the model FLOPs its training step
ran at; read as model FLOPs it would be 732 TFLOP/s per GPU (56% MFU), above what AMD measures its
best GEMM at. The planner's MI300X GEMM rate is that MAF. Cases: the shipped config (its own mesh,
attention_kernel auto = the XLA path on GPU, the same mesh with the flash kernel, and without
distributed Muon, as shipped before), the previously shipped data=512,tensor=2 with each
kernel, Zyphra's data=1024 with each kernel, the mesh `plan --search` picks (also on 1,024 H200,
the other launch job), the flash kernel without remat (nothing recomputed), and the GEMM
efficiency at which the prediction would reach 56% MFU (null: not even at 100%).
"""

from __future__ import annotations

import copy
import dataclasses
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from benchmarks.common import print_and_save  # noqa: E402
from zaya_jax.config_files import load_config_file, model_config  # noqa: E402
from zaya_jax.hardware import MAF_SOURCE, PROFILES  # noqa: E402
from zaya_jax.parallel.mesh import parse_mesh_flag, resolve_mesh_shape  # noqa: E402
from zaya_jax.planner.mesh_search import search  # noqa: E402
from zaya_jax.planner.phase_plan import config_phases, phase_mesh, phase_shape, plan_phase  # noqa: E402
from zaya_jax.planner.step_plan import StepShape  # noqa: E402

DEVICES = 1024
SEED_PFLOPS = 750.0


def base_shape(config, gradient_reduce_dtype: str | None = None, microbatches: int = 0) -> StepShape:
    """The config's step; gradient_reduce_dtype None: its mesh.gradient_reduce_dtype; microbatches 0:
    its train.microbatches."""
    return StepShape(1, 1, grad_accum=microbatches or config.train.microbatches, optimizer=config.optimizer.name,
                     shard_optimizer_over_data=config.mesh.shard_optimizer_over_data, platform="gpu",
                     ns_steps=config.optimizer.muon_ns_steps, distributed_muon=config.optimizer.muon_distributed,
                     loss_chunk=config.train.loss_chunk_size,
                     gradient_reduce_dtype=gradient_reduce_dtype or config.mesh.gradient_reduce_dtype)


def without_distributed_muon(config):
    config = copy.deepcopy(config)
    config.optimizer.muon_distributed = False
    return config


def summarise(result: dict) -> dict:
    p = result["prediction"]
    executed = sum(p["flops_per_device"].values())
    return {"mesh": {a: n for a, n in result["mesh"].items() if n > 1}, "fits": result["fits"],
            "memory_gib": result["bytes_per_device"]["total"] / 2**30, "step_s": p["step_s"],
            "step_s_no_overlap": p["step_s_no_overlap"], "compute_s": p["compute_s"], "memory_s": p["memory_s"],
            "blocking_collectives_s": p["blocking_collectives_s"],
            "overlapped_collectives_s": p["overlapped_collectives_s"], "tokens_per_s": p["tokens_per_s"],
            "mfu": p["mfu"], "cluster_model_pflops": p["model_flops_per_s_per_device"] * DEVICES / 1e15,
            "executed_tflops_per_device_per_step": executed / 1e12,
            "hardware_flops_utilisation": executed / p["step_s"] / (PROFILES["mi300x"].matmul_tflops * 1e12),
            "bound_by": p["bound_by"], "flops_per_device": p["flops_per_device"],
            "hbm_bytes_per_device": p["hbm_bytes_per_device"], "collectives": p["collectives"]}


def phase_cases(cfg, config, mesh: str | None, hw, gradient_reduce_dtype: str | None = None,
                microbatches: int = 0) -> list[dict]:
    """Every phase on `mesh` (None: the config's own mesh for each phase), with the days it takes."""
    out = []
    for phase in config_phases(config):
        sizes = phase_mesh(config, phase, parse_mesh_flag(mesh) if mesh else None)
        try:
            shape = phase_shape(base_shape(config, gradient_reduce_dtype, microbatches), phase)
            case = summarise(plan_phase(cfg, shape, resolve_mesh_shape(sizes, DEVICES),
                                        hw, hw.memory_gb))
            out.append({"phase": phase.name, **case, "days": phase.num_batches * case["step_s"] / 86400})
        except ValueError as e:
            out.append({"phase": phase.name, "error": str(e)})
    return out


def matmul_efficiency_for(cfg, config, mesh: str, target_mfu: float) -> float | None:
    """The GEMM efficiency at which phase 1's predicted MFU reaches target_mfu (bisection; None:
    not even at 100%)."""
    base = PROFILES["mi300x"]

    def mfu_at(matmul: float) -> float:
        hw = dataclasses.replace(base, efficiency=dataclasses.replace(base.efficiency, matmul=matmul))
        return phase_cases(cfg, config, mesh, hw)[0]["mfu"]

    if mfu_at(1.0) < target_mfu:
        return None
    low, high = 0.05, 1.0
    for _ in range(20):
        mid = (low + high) / 2
        low, high = (mid, high) if mfu_at(mid) < target_mfu else (low, mid)
    return high


def main():
    config = load_config_file("configs/zaya1_base.py")
    cfg = model_config(config)
    flash = cfg.replace(attention_kernel="pallas")
    hw = PROFILES["mi300x"]
    seed_mfu = SEED_PFLOPS * 1e15 / DEVICES / (hw.matmul_tflops * 1e12)
    found = search(cfg, config_phases(config), base_shape(config), DEVICES, hw, hw.memory_gb)
    found_flash = search(flash, config_phases(config), base_shape(config), DEVICES, hw, hw.memory_gb)
    h200 = PROFILES["h200"]
    found_h200 = search(cfg, config_phases(config), base_shape(config), DEVICES, h200, h200.memory_gb)
    pick = found["whole_run"][0]["mesh"]
    result = {
        "what": "ZAYA1-base predicted on 1,024 MI300X by the planner (paper numbers, no GPU run)",
        "hardware": dataclasses.asdict(hw),
        "seed": {"reported_cluster_pflops": SEED_PFLOPS,
                 "what_it_counts": "the cluster's Max Achievable FLOPS (AMD, 'Zyphra Demonstrates Large Scale "
                                   "Training on AMD GPUs & Networking with ZAYA1', Nov 22 2025), not model FLOPs",
                 "cluster_maf_pflops": DEVICES * hw.matmul_tflops * hw.efficiency.matmul / 1e3,
                 "maf_source": MAF_SOURCE,
                 "per_gpu_tflops_if_model_flops": SEED_PFLOPS * 1e3 / DEVICES, "mfu_if_model_flops": seed_mfu},
        "shipped_config_mesh_xla_attention": phase_cases(cfg, config, None, hw),
        "shipped_config_mesh_flash_attention": phase_cases(flash, config, None, hw),
        # optimizer.muon_distributed off, as shipped before: every Newton-Schulz matmul gathers its
        # whole operand on ZeRO-1's matrix-axis slice (step_plan.collectives)
        "shipped_config_mesh_xla_attention_muon_not_distributed": phase_cases(cfg, without_distributed_muon(config),
                                                                              None, hw),
        "data512_tensor2_xla_attention": phase_cases(cfg, config, "data=512,tensor=2", hw),
        "data512_tensor2_flash_attention": phase_cases(flash, config, "data=512,tensor=2", hw),
        "data1024_xla_attention": phase_cases(cfg, config, "data=1024", hw),
        "data1024_flash_attention": phase_cases(flash, config, "data=1024", hw),
        "data1024_flash_attention_no_remat": phase_cases(flash.replace(remat="none"), config, "data=1024", hw),
        # mesh.gradient_reduce_dtype='bfloat16' (zaya_jax.parallel.gradient_reduce): the data-axis
        # gradients reduce-scattered once per step in bf16 after the backward (not behind it); the
        # updated (float32) parameters' all-gather unchanged. With 4 micro-batches the partitioner
        # reduces float32 gradients in each of them.
        "shipped_config_mesh_xla_attention_bf16_gradients": phase_cases(cfg, config, None, hw, "bfloat16"),
        "data1024_flash_attention_bf16_gradients": phase_cases(flash, config, "data=1024", hw, "bfloat16"),
        "shipped_config_mesh_xla_attention_4_microbatches": phase_cases(cfg, config, None, hw, "float32", 4),
        "shipped_config_mesh_xla_attention_4_microbatches_bf16_gradients": phase_cases(cfg, config, None, hw,
                                                                                       "bfloat16", 4),
        "search": {"xla_attention": {"whole_run_top5": found["whole_run"][:5],
                                     "phase_top3": {p["name"]: p["ranked"][:3] for p in found["phases"]}},
                   "flash_attention": {"whole_run_top5": found_flash["whole_run"][:5],
                                       "phase_top3": {p["name"]: p["ranked"][:3] for p in found_flash["phases"]}}},
        "search_h200_xla_attention": {"whole_run_top5": found_h200["whole_run"][:5],
                                      "previous_data512_tensor2": next(
                                          r for r in found_h200["whole_run"] if r["mesh"] == "data=512,tensor=2")},
        "search_pick_xla_attention": {"mesh": pick, "phases": phase_cases(cfg, config, pick, hw)},
        "matmul_efficiency_for_seed_mfu": {
            "xla_attention_data1024": matmul_efficiency_for(cfg, config, "data=1024", seed_mfu),
            "flash_attention_data1024": matmul_efficiency_for(flash, config, "data=1024", seed_mfu),
            "flash_attention_no_remat_data1024": matmul_efficiency_for(flash.replace(remat="none"), config,
                                                                       "data=1024", seed_mfu)},
    }
    result["whole_run_days"] = {name: sum(p["days"] for p in phases) for name, phases in result.items()
                                if isinstance(phases, list) and all("days" in p for p in phases)}
    print_and_save(result, "planner_predictions.json")


if __name__ == "__main__":
    main()
