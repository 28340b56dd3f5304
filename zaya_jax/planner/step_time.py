"""Predicted time of one training step on a hardware profile, from FLOPs, HBM bytes and collectives.

  compute     matmul FLOPs per device (zaya_jax.planner.step_flops) / achieved matmul rate; under an
              FP8 recipe (model.matmul_precision) the CCA projections' and experts' FLOPs at the
              achieved FP8 rate (HardwareProfile.fp8_matmul_tflops), the rest at bf16's; MFU stays
              model FLOPs over the bf16 peak; HBM traffic is counted as bf16's (FP8 operands would
              halve the projections' and experts' reads: not modelled)
  memory      HBM bytes the non-matmul work moves per device / achieved HBM bandwidth:
                activations: elementwise work is assumed fused between matmuls, so a layer's traffic
                  is its matmuls' activation inputs read and outputs written (step_flops.LayerMatmul;
                  the XLA attention path also writes and reads fp32 logits and the probabilities),
                  once forward, twice backward, once more where remat recomputes the matmul
                loss head: the fp32 logits of each chunk, written and read, and their gradient, written
                  and read (lm, sft: one pass, train.loss.weighted_nll_sum); for dpo and grpo the
                  logits again where they are recomputed (6 trips); over the positions the loss head
                  computes (a GRPO step's: the T completion columns of each row)
                optimizer: the update reads and writes its shard of parameters and optimizer state
                  and reads the gradient; gradients accumulate once per micro-batch
                reference model (dpo; grpo with grpo.beta > 0: StepShape.holds_reference; step_flops
                  counts its forward as one pass of every layer op and of the loss head): its fp32
                  parameter shard read once per micro-batch, each layer op's activation traffic once
                  (forward only: no backward, no recompute) and the loss head's fp32 logits written
                  and read once
              matmul operands are assumed hidden in the matmul time (large GEMMs are compute-bound)
  collective  bytes per device over the link its mesh axis crosses (link_of) / achieved bus bandwidth

Overlap assumptions (stated in the plan's output):
  - matmul, memory-bound and activation collectives (expert all-to-all, tensor all-reduce, context
    all-gather) run one after another: the activations they move are needed next;
  - weight and gradient collectives (FSDP all-gather / reduce-scatter, data-parallel gradient
    reduction) run behind compute and memory work (XLA's latency-hiding scheduler and collective
    pipelining); only what exceeds that work is exposed.
  `step_s` uses both; `step_s_no_overlap` adds every collective serially (the pessimistic bound).
"""

from __future__ import annotations

import math

from zaya_jax.config import ModelConfig
from zaya_jax.errors import UserError
from zaya_jax.hardware import HardwareProfile
from zaya_jax.parallel.mesh import MESH_AXES
from zaya_jax.parallel.rules import zero1_axes
from zaya_jax.planner.step_flops import (dispatched_experts, expert_backend, expert_rows_per_token, layer_matmuls,
                                         recomputed, step_flops)
from zaya_jax.planner.step_plan import Collective, StepShape, collectives, muon_matrices
from zaya_jax.planner.tower_plan import tower_step_flops
from zaya_jax.train.objectives import fuses_loss_head

OVERLAP_ASSUMPTIONS = (
    "matmuls, memory-bound work and activation collectives (expert all-to-all, tensor all-reduce, context "
    "all-gather) run serially; weight/gradient collectives (FSDP all-gather and reduce-scatter, data-parallel "
    "gradient reduction) overlap with compute and only their excess is exposed; matmul operand traffic is "
    "hidden in the matmul time")


def link_of(axis: str, mesh: dict[str, int], devices_per_node: int) -> tuple[str, int]:
    """-> ('intra_node' | 'inter_node', members of the group inside one node); `axis`: a mesh
    axis, or axes joined by '+' (one collective over all their devices).

    Devices fill the mesh in MESH_AXES order with the last axis fastest, and a node holds
    consecutive devices: an axis with `inner` devices after it (the product of the sizes of the
    axes after it) has min(size, devices_per_node // inner) members in a node, at least 1; the
    group stays inside a node when all its members are.
    """
    members = size = 1
    for name in axis.split("+"):
        inner = math.prod(mesh[a] for a in MESH_AXES[MESH_AXES.index(name) + 1:])
        members *= min(mesh[name], max(1, devices_per_node // inner))
        size *= mesh[name]
    return ("intra_node" if members == size else "inter_node"), members


def collective_seconds(c: Collective, mesh: dict[str, int], hw: HardwareProfile) -> tuple[str, float]:
    """Seconds of one collective. Across nodes, an axis with g members per node sends 1/g of its
    bytes over each GPU's NIC (rings over the g local NICs, or hierarchical algorithms) and the
    rest over the node's scale-up links."""
    rates = hw.achieved()
    link, members = link_of(c.axis, mesh, hw.devices_per_node)
    if link == "intra_node":
        return hw.intra_node_link, c.bytes / rates["intra_node_bytes"]
    nic = c.bytes / members / rates["inter_node_bytes"]
    return "NIC", max(nic, c.bytes / rates["intra_node_bytes"] if members > 1 else 0.0)


def hbm_bytes(cfg: ModelConfig, mesh: dict[str, int], shape: StepShape, plan_result: dict) -> dict[str, float]:
    """HBM traffic per device per step that matmul time does not cover, by part (module docstring)."""
    tokens = plan_result["tokens_per_device_per_microbatch"] * shape.grad_accum
    backend = expert_backend(cfg, mesh, shape.platform)
    vision = shape.vision is not None
    rows = expert_rows_per_token(cfg, backend, max(1, int(plan_result["tokens_per_device_per_microbatch"])),
                                 dispatched_experts(cfg, vision))
    ops = layer_matmuls(cfg, shape.seq_len, backend, rows, vision_lora=vision)
    per_pass = {op.name: tokens * cfg.num_layers * op.activation_bytes / (mesh["tensor"] if op.tensor_split else 1)
                for op in ops}  # one pass (forward) of every layer op
    # fp32 logits of every position the loss head computes, once
    logits = tokens * shape.loss_head_len / shape.seq_len * cfg.vocab_size / mesh["tensor"] * 4
    mem = plan_result["bytes_per_device"]
    opt_fraction = 1 / math.prod(mesh[a] for a in zero1_axes(mesh)) if shape.shard_optimizer_over_data else 1.0
    traffic = {
        "activations": sum(per_pass[op.name] * (1 + 2 + recomputed(op, cfg.remat)) for op in ops),
        "loss_logits": logits * (4 if fuses_loss_head(shape.objective) else 6),
        "optimizer": opt_fraction * (2 * mem["params"] + mem["grads"]) + 2 * mem["optimizer_state"]
                     + mem["grads"] * shape.grad_accum,
    }
    if shape.holds_reference:
        traffic["reference_model"] = mem["reference_model"] * shape.grad_accum + sum(per_pass.values()) + 2 * logits
    return traffic


# step_flops' groups that model.matmul_precision runs in FP8 (zaya_jax.model.fp8): CCA's projections
# and the experts; the rest (convolutions, scores, router, loss head, Newton-Schulz) at the bf16 rate
FP8_MATMULS = ("attention/qk_projections", "attention/value_projections", "attention/output_projection", "experts")


def matmul_flops(cfg: ModelConfig, mesh: dict[str, int], shape: StepShape, parameters: list) -> dict[str, float]:
    """step_flops for a StepShape, and a vision step's tower (tower_plan); parameters: planner._parameters."""
    flops = step_flops(cfg, mesh, global_batch=shape.global_batch, seq_len=shape.seq_len,
                       microbatches=shape.grad_accum, platform=shape.platform,
                       optimizer_matrices=muon_matrices(mesh, shape, parameters), ns_steps=shape.ns_steps,
                       loss_chunk=shape.loss_chunk, objective=shape.objective,
                       loss_head_positions=shape.loss_head_len, reference_model=shape.holds_reference,
                       frozen_text=shape.freeze_text,
                       vision_step=shape.vision is not None)
    if shape.vision is not None:
        rows = shape.global_batch / (mesh["data"] * mesh["fsdp"] * mesh["expert"])
        flops |= tower_step_flops(shape.vision, cfg.remat, rows, shape.patch_capacity, mesh["tensor"])
    return flops


def predict(cfg: ModelConfig, mesh: dict[str, int], shape: StepShape, plan_result: dict, parameters: list,
            hw: HardwareProfile, model_flops_per_token: float) -> dict:
    """Predicted step time, throughput and MFU of one phase's step shape on `hw`.

    plan_result: planner.plan's dict for (cfg, mesh, shape); parameters: planner._parameters;
    model_flops_per_token: the MFU numerator per token (zaya_jax.train.metrics.flops_per_token).
    """
    rates = hw.achieved()
    devices = math.prod(mesh.values())
    flops = matmul_flops(cfg, mesh, shape, parameters)
    traffic = hbm_bytes(cfg, mesh, shape, plan_result)
    fp8 = sum(flops.get(name, 0.0) for name in FP8_MATMULS) if cfg.matmul_precision != "default" else 0.0
    if fp8 and not hw.fp8_matmul_tflops:
        raise UserError(f"model.matmul_precision={cfg.matmul_precision!r}: {hw.name} has no FP8 matmuls; set "
                        "model.matmul_precision='default' or plan for an FP8 GPU")
    compute_s = (sum(flops.values()) - fp8) / rates["matmul_flops"] + (fp8 / rates["fp8_matmul_flops"] if fp8 else 0.0)
    memory_s = sum(traffic.values()) / rates["hbm_bytes"]
    rows, blocking_s, overlappable_s = [], 0.0, 0.0
    for c in collectives(cfg, mesh, shape, plan_result["bytes_per_device"], parameters):
        link, seconds = collective_seconds(c, mesh, hw)
        rows.append({"kind": c.kind, "axis": c.axis, "what": c.what, "link": link, "bytes": c.bytes,
                     "seconds": seconds, "overlapped": c.overlappable})
        if c.overlappable:
            overlappable_s += seconds
        else:
            blocking_s += seconds
    busy_s = compute_s + memory_s
    step_s = busy_s + blocking_s + max(0.0, overlappable_s - busy_s)
    terms = {"compute": compute_s, "memory": memory_s}
    for r in rows:
        name = f"{r['kind']} over {r['axis']} ({r['link']})"
        terms[name] = terms.get(name, 0.0) + r["seconds"]
    tokens_per_s = shape.global_batch * shape.seq_len / step_s
    return {
        "hardware": hw.name, "flops_per_device": flops, "hbm_bytes_per_device": traffic, "collectives": rows,
        "compute_s": compute_s, "memory_s": memory_s, "blocking_collectives_s": blocking_s,
        "overlapped_collectives_s": overlappable_s, "step_s": step_s,
        "step_s_no_overlap": busy_s + blocking_s + overlappable_s,
        "tokens_per_s": tokens_per_s,
        "model_flops_per_s_per_device": model_flops_per_token * tokens_per_s / devices,
        "fp8_matmul_flops_per_device": fp8,
        "mfu": model_flops_per_token * tokens_per_s / (devices * hw.matmul_tflops * 1e12),
        "bound_by": max(terms, key=terms.get), "overlap_assumptions": OVERLAP_ASSUMPTIONS,
    }
