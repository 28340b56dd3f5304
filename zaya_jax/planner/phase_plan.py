"""Plan every curriculum phase of a config on a hardware profile: memory, FLOPs, HBM traffic,
collectives, predicted step time, tokens/s and MFU per phase, and the whole run's time.

A phase's step shape is the config's (optimizer, micro-batches, optimizer-state sharding) with
the phase's global batch and sequence length; its mesh comes from `phase_mesh`.
"""

from __future__ import annotations

import dataclasses
import functools
import math

from zaya_jax.config import ModelConfig
from zaya_jax.data.curriculum import PhaseInfo
from zaya_jax.hardware import HardwareProfile
from zaya_jax.model.vision.accounting import tower_forward_flops
from zaya_jax.parallel.mesh import phase_mesh_sizes, resolve_mesh_shape
from zaya_jax.planner.step_plan import StepShape, _parameters, plan
from zaya_jax.planner.step_time import predict
from zaya_jax.train.data import phases_of
from zaya_jax.train.metrics import flops_per_token
from zaya_jax.train.settings import settings_from_config


def config_phases(config) -> tuple[PhaseInfo, ...]:
    """The curriculum phases (one 'synthetic' phase for train.data=synthetic configs)."""
    return phases_of(config, settings_from_config(config))


def grpo_step_fields(config) -> dict:
    """A GRPO config's StepShape fields: its loss head computes T = grpo.max_completion_length
    positions per row (the columns from max_prompt_length - 1 on: train.objectives.GRPOObjective's
    scored_from), and grpo.beta > 0 holds a reference model. {} for any other objective."""
    if config.get("train", {}).get("objective") != "grpo":
        return {}
    grpo = settings_from_config(config).grpo  # the section with GRPOSettings' defaults, as the trainer reads it
    return {"loss_head_positions": grpo.max_completion_length, "grpo_beta": grpo.beta}


def phase_mesh(config, phase: PhaseInfo, cli_mesh: dict[str, int] | None) -> dict[str, int]:
    """The mesh sizes a phase runs on (one may be -1): --mesh when given, else the config's
    (zaya_jax.parallel.mesh.phase_mesh_sizes, the one place a phase's mesh is read)."""
    if cli_mesh is not None:
        return dict(cli_mesh)
    return phase_mesh_sizes(config, phase)


@functools.lru_cache(maxsize=64)
def _model_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """flops_per_token, which traces the abstract model: once per (config, length), not once per
    mesh and phase (the search plans hundreds)."""
    return flops_per_token(cfg, seq_len)


def phase_shape(base: StepShape, phase: PhaseInfo) -> StepShape:
    return dataclasses.replace(base, global_batch=phase.global_batch_size, seq_len=phase.seq_len)


def plan_phase(cfg: ModelConfig, shape: StepShape, mesh: dict[str, int], hw: HardwareProfile,
               device_memory_gb: float, parameters: list | None = None) -> dict:
    """planner.plan's memory and collectives plus step_time.predict's prediction, for one step shape.
    Raises ValueError when the mesh cannot run the shape (batch or sequence does not divide)."""
    mesh = resolve_mesh_shape(mesh, math.prod(mesh.values()))
    parameters = parameters or _parameters(cfg, mesh, shape.vision)
    memory = plan(cfg, mesh, shape, device_memory_gb, parameters)
    model_flops = _model_flops_per_token(cfg, shape.seq_len)
    if shape.vision is not None:  # MFU counts the tower's forward and backward too, per text position
        model_flops += 3 * tower_forward_flops(shape.vision, shape.patch_capacity) / shape.seq_len
    memory["prediction"] = predict(cfg, mesh, shape, memory, parameters, hw, model_flops)
    return memory


def run_time(phases: tuple[PhaseInfo, ...], plans: list[dict]) -> dict:
    """Days each phase and the whole curriculum take at the predicted step times."""
    days = [p.num_batches * r["prediction"]["step_s"] / 86400 for p, r in zip(phases, plans)]
    return {"days_per_phase": days, "days_total": sum(days),
            "tokens_total": sum(p.num_batches * p.tokens_per_batch for p in phases)}
