"""Every mesh of a device count that can run a config, ranked by predicted step time per phase.

Candidates: all ways to write the device count as data * fsdp * expert * tensor * context with
tensor dividing the query and KV heads and the expert hidden size, expert dividing the number of
experts and context dividing every phase's sequence length (cheap checks first); then a mesh is
feasible for a phase when every parameter shards over it (zaya_jax.parallel.rules), the phase's
batch splits over data * fsdp * expert times the micro-batches and its memory fits the device
(both attention kernels run context parallelism). Predictions within TIE (2%) of the fastest are
ties, won by the mesh that depends least on overlap. A vision-language config (StepShape.vision)
runs on context = 1 only (train.settings.check_vision_run): the others are infeasible.
"""

from __future__ import annotations

import math

from zaya_jax.config import ModelConfig
from zaya_jax.data.curriculum import PhaseInfo
from zaya_jax.hardware import HardwareProfile
from zaya_jax.parallel.gradient_reduce import unsupported_axes
from zaya_jax.parallel.mesh import MESH_AXES
from zaya_jax.planner.phase_plan import phase_shape, plan_phase
from zaya_jax.planner.step_plan import StepShape, _parameters


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_meshes(cfg: ModelConfig, devices: int, seq_lens: list[int]) -> list[dict[str, int]]:
    tensor_ok = math.gcd(cfg.num_q_heads, cfg.num_kv_heads, cfg.moe_intermediate_size)
    out = []
    for tensor in _divisors(math.gcd(devices, tensor_ok)):
        for expert in _divisors(math.gcd(devices // tensor, cfg.num_experts)):
            for context in _divisors(math.gcd(devices // (tensor * expert), *seq_lens)):
                rest = devices // (tensor * expert * context)
                for fsdp in _divisors(rest):
                    out.append({"data": rest // fsdp, "fsdp": fsdp, "expert": expert, "tensor": tensor,
                                "context": context})
    return out


VISION_CONTEXT = "context > 1 (a vision-language run needs mesh.context = 1)"

# Predictions closer than this (relative) are ties: below what the model resolves (its overlap,
# fusion and efficiency assumptions move a step by more), so the tie goes to the mesh with less to
# hide, the smaller time with every collective exposed.
TIE = 0.02


def ranked(rows: list[dict], key: str) -> list[dict]:
    """rows fastest first by rows[key], except that the rows within TIE of the fastest come first
    ordered by rows[key + '_no_overlap'] (the module's tie rule)."""
    rows = sorted(rows, key=lambda r: r[key])
    ties = [r for r in rows if r[key] <= rows[0][key] * (1 + TIE)]
    return sorted(ties, key=lambda r: r[key + "_no_overlap"]) + rows[len(ties):]


def mesh_name(mesh: dict[str, int]) -> str:
    return ",".join(f"{a}={mesh[a]}" for a in MESH_AXES if mesh[a] > 1) or "1 device"


def search(cfg: ModelConfig, phases: tuple[PhaseInfo, ...], base: StepShape, devices: int,
           hw: HardwareProfile, device_memory_gb: float) -> dict:
    """-> {"phases": [{name, ranked: [{mesh, step_s, mfu, bound_by, memory_gib}], infeasible: {reason: n}}],
           "whole_run": [{mesh, days}] (meshes feasible in every phase, fastest first)}."""
    per_phase = [{"name": p.name, "ranked": [], "infeasible": {}} for p in phases]
    whole_run = []
    candidates = candidate_meshes(cfg, devices, [p.seq_len for p in phases])
    for mesh in candidates:
        reason = "mesh.gradient_reduce_dtype refuses it" if unsupported_axes(mesh, base.gradient_reduce_dtype) else None
        if base.vision is not None and mesh["context"] > 1:
            reason = VISION_CONTEXT
        if reason is None:
            try:
                parameters = _parameters(cfg, mesh, base.vision)
            except ValueError:
                reason = "a parameter does not shard"
        if reason:
            for entry in per_phase:
                entry["infeasible"][reason] = entry["infeasible"].get(reason, 0) + 1
            continue
        days, days_no_overlap, feasible_everywhere = 0.0, 0.0, True
        for phase, entry in zip(phases, per_phase):
            try:
                result = plan_phase(cfg, phase_shape(base, phase), mesh, hw, device_memory_gb, parameters)
            except ValueError:
                reason = "batch or sequence does not split"
            else:
                reason = None if result["fits"] else "does not fit in memory"
            if reason:
                entry["infeasible"][reason] = entry["infeasible"].get(reason, 0) + 1
                feasible_everywhere = False
                continue
            pred = result["prediction"]
            entry["ranked"].append({"mesh": mesh_name(mesh), "step_s": pred["step_s"],
                                    "step_s_no_overlap": pred["step_s_no_overlap"], "mfu": pred["mfu"],
                                    "bound_by": pred["bound_by"],
                                    "memory_gib": result["bytes_per_device"]["total"] / 2**30})
            days += phase.num_batches * pred["step_s"] / 86400
            days_no_overlap += phase.num_batches * pred["step_s_no_overlap"] / 86400
        if feasible_everywhere:
            whole_run.append({"mesh": mesh_name(mesh), "days": days, "days_no_overlap": days_no_overlap})
    for entry in per_phase:
        entry["ranked"] = ranked(entry["ranked"], "step_s")
    whole_run = ranked(whole_run, "days")
    return {"devices": devices, "hardware": hw.name, "candidates": len(candidates), "phases": per_phase,
            "whole_run": whole_run}
