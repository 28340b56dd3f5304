"""Plan a run before launching it, from an abstract init (nothing is allocated).

  python -m zaya_jax.planner --config configs/zaya1_base.py [--json] [--config.model.num_layers=4]
  python -m zaya_jax.planner --config configs/zaya1_base.py --mesh data=128,fsdp=8 [--device_memory_gb 192]
  python -m zaya_jax.planner --config configs/zaya1_base.py --mesh data=1024 --hardware mi300x [--calibration rates.json]
  python -m zaya_jax.planner --config configs/zaya1_base.py --search --devices 1024 --hardware mi300x
  python -m zaya_jax.planner --config configs/zaya1_8b.py --serve [--hardware h200] [--context 4096]

Always: parameter counts and the KV-cache size (with a `vision` section, ZAYA1-VL's: the tower's
parameters and its forward FLOPs on one --image_size image). With --mesh: per-device bytes of
parameters, gradients, optimizer state and activations, collective bytes per step by kind, and
whether it fits the device memory (default: the --hardware profile's, else 192 GB, an MI300X).
A vision-language config's step (it must be a valid vision run: train.objective='sft',
train.patch_capacity, mesh.context = 1) adds the tower's parameters, gradients and AdamW state
(sharded by the trainer's rules), its activations and FLOPs (forward and backward) on
train.patch_capacity patches per row and its parameters' collectives; with train.freeze_text the
text weights but the vision LoRA have no gradient, optimizer state or gradient collectives and no
weight-gradient matmuls (zaya_jax.planner.step_plan, tower_plan). With
--hardware, per curriculum phase: FLOPs, HBM traffic and collectives per device and step, the
predicted step time, tokens/s, MFU and what bounds it (docs/parallel.md, Planner). With
--search: every feasible mesh of --devices ranked by predicted step time, per phase and for the
whole run. With --serve: serving on one GPU of --hardware (default: every profile) at --context
tokens per request: weight bytes (the compute dtype, int8, int4), one request's decode state, the
requests that fit and the decode tokens/s roofline at batches up to that (zaya_jax.planner.serve_plan).
"""

from __future__ import annotations

import dataclasses
import json
import math

from absl import app, flags
from ml_collections import config_flags

from zaya_jax import cli

from zaya_jax.config import ConfigError
from zaya_jax.config_files import model_config, vision_config
from zaya_jax.hardware import PROFILES, calibrated
from zaya_jax.checkpoints.quantize import MODES
from zaya_jax.model.accounting import model_summary
from zaya_jax.parallel.gradient_reduce import GRADIENT_REDUCE_DTYPES, check_mesh
from zaya_jax.parallel.mesh import MESH_FLAG, parse_mesh_flag, resolve_mesh_shape
from zaya_jax.planner.goodput import (INTERVAL_STEPS, against_the_interval, best_every, goodput,
                                     llama3_storage_share_gbps, tier_seconds)
from zaya_jax.planner.serve_plan import RESERVE_FRACTION, SERVE_ASSUMPTIONS, plan_serving
from zaya_jax.planner.mesh_search import VISION_CONTEXT, mesh_name, search
from zaya_jax.planner.phase_plan import (config_phases, grpo_step_fields, phase_mesh, phase_shape, plan_phase,
                                         run_time)
from zaya_jax.model.vision.accounting import vl_model_summary
from zaya_jax.parallel.rules import check_axes_divide
from zaya_jax.planner.step_plan import GIB, StepShape, parameter_memory, parameter_states, plan
from zaya_jax.planner.step_time import OVERLAP_ASSUMPTIONS
from zaya_jax.train.settings import settings_from_config

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a config file (configs/*.py).")
_JSON = flags.DEFINE_bool("json", False, "Print machine-readable JSON.")
_MESH = flags.DEFINE_string("mesh", None, "Mesh to plan for, e.g. data=128,fsdp=8 (any size; no devices needed).")
_MEMORY = flags.DEFINE_float("device_memory_gb", None, "Device memory in GB (default: the --hardware profile's, "
                             "else 192, an MI300X).")
_HARDWARE = flags.DEFINE_enum("hardware", None, sorted(PROFILES),
                              "Predict each curriculum phase's step time, tokens/s and MFU on this GPU "
                              "(profiles: zaya_jax/hardware.py).")
_CALIBRATION = flags.DEFINE_string("calibration", None, "JSON of measured rates (device_kind, matmul_tflops, "
                                   "hbm_gbps, intra_node_gbps, inter_node_gbps) replacing the --hardware "
                                   "profile's efficiency assumptions.")
_SEARCH = flags.DEFINE_bool("search", False, "Rank every feasible mesh of --devices by predicted step time "
                            "(needs --hardware).")
_DEVICES = flags.DEFINE_integer("devices", None, "Device count for --search, or for a config mesh with -1 "
                                "(default: the --mesh product).")
_TOP = flags.DEFINE_integer("top", 5, "Meshes listed per phase by --search.")
_ACCUM = flags.DEFINE_integer("grad_accum", None, "Micro-batches per step (default: config train.microbatches or 1).")
_OPTIMIZER = flags.DEFINE_enum("optimizer", None, ["adamw", "muon"], "Optimizer (default: config optimizer.name).")
_PLATFORM = flags.DEFINE_enum("platform", "gpu", ["gpu", "cpu"], "Target platform (picks the auto MoE backend).")
_REDUCE_DTYPE = flags.DEFINE_enum("gradient_reduce_dtype", None, list(GRADIENT_REDUCE_DTYPES),
                                  "The data-axis gradient sum's wire dtype (default: config "
                                  "mesh.gradient_reduce_dtype or float32).")
_IMAGE_SIZE = flags.DEFINE_string("image_size", "448x448", "A config with a vision section: the image (HEIGHTxWIDTH "
                                  "pixels) whose tower FLOPs are counted.")
_ZERO1 = flags.DEFINE_bool("shard_optimizer_over_data", None,
                           "Optimizer state also sharded over data x context (default: config mesh.shard_optimizer_over_data).")
_SERVE = flags.DEFINE_bool("serve", False, "Predict serving on one GPU of --hardware (default: every profile): "
                           "memory per request, slots, decode tokens/s (zaya_jax.planner.serve_plan).")
_CONTEXT = flags.DEFINE_integer("context", 4096, "--serve: tokens each request holds (cache slots).")
_RESERVE = flags.DEFINE_float("memory_reserve", RESERVE_FRACTION, "--serve: fraction of device memory kept for "
                              "activations and workspace (not for weights or decode state).")
_GROUP_SIZE = flags.DEFINE_integer("group_size", 64, "--serve: entries per scale of the int8/int4 weights "
                                   "(zaya_jax.checkpoints.quantize).")
_MTBF = flags.DEFINE_float("node_mtbf_hours", None, "With --hardware: goodput under node failures at this mean time "
                           "between failures per node (Llama 3's report: about 6,335 h), with and without the local "
                           "checkpoint tier (zaya_jax.planner.goodput).")
_RESTART = flags.DEFINE_float("restart_minutes", 10.0, "--node_mtbf_hours: minutes from a failure to training again, "
                              "before reading the checkpoint back (scheduling, start-up).")
_STORAGE = flags.DEFINE_float("storage_gbps", None, "--node_mtbf_hours: GB/s the job writes and reads the persistent "
                              "tier at (default: its GPUs' share of Llama 3's sustained 2 TB/s for 16,384 GPUs).")
_LOCAL_DISK = flags.DEFINE_float("local_disk_gbps", 0.5, "--node_mtbf_hours: GB/s each node writes and reads its local "
                                 "tier at (default: about benchmarks/checkpoints/checkpoint_tiers.py's measured local write on a "
                                 "CPU machine's disk; pass your nodes').")
_STALL = flags.DEFINE_float("save_stall_s", 2.0, "--node_mtbf_hours: seconds a persistent save blocks the loop.")
_LOCAL_STALL = flags.DEFINE_float("local_stall_s", None, "--node_mtbf_hours: seconds a local save blocks the loop "
                                  "(default: twice --save_stall_s, its own copy and its neighbour's).")
_LOCAL_EVERY = flags.DEFINE_integer("local_every", 0, "--node_mtbf_hours: the local tier's interval (default: the "
                                    "config's checkpoint.local_every, else 100).")


def _human(n: float) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3f}{unit}"
    return str(n)


def render(summary: dict) -> str:
    lines = ["parameters by module"]
    total = summary["params_total"]
    for name, count in summary["breakdown"].items():
        lines.append(f"  {name:<28}{_human(count):>12}  {100 * count / total:5.1f}%")
    for key in ("params_total", "params_non_embedding", "params_active_non_embedding", "params_active_total"):
        lines.append(f"{key:<30}{_human(summary[key]):>12}")
    lines.append(f"{'kv_cache_bytes_per_token':<30}{summary['kv_cache_bytes_per_token'] / 1024:>10.1f}KiB (bf16)")
    if summary["kv_cache_window_bytes"]:
        lines.append(f"{'kv_cache_window_bytes':<30}{summary['kv_cache_window_bytes'] / 2**20:>10.1f}MiB (bf16, "
                     "sliding layers' ring buffers, per sequence)")
    if "vision" in summary:
        image = summary["vision"]["image"]
        lines.append(f"{'vision_param_bytes_fp32':<30}{summary['vision']['param_bytes_fp32'] / GIB:>10.2f}GiB")
        lines.append(f"one {image['pixels'][0]}x{image['pixels'][1]} image (resized to {image['resized_to'][0]}x"
                     f"{image['resized_to'][1]}): {image['patches']} patches, {image['tokens']} text tokens, "
                     f"tower forward {image['forward_flops'] / 1e12:.2f} TFLOP")
    if "plan" in summary:
        p = summary["plan"]
        mesh = ",".join(f"{a}={n}" for a, n in p["mesh"].items() if n > 1) or "1 device"
        lines.append(f"per device on {mesh} ({p['devices']} devices), {p['remat']} remat, {p['dtype']}, step of "
                     f"{p['step']['global_batch']} x {p['step']['seq_len']} tokens ({p['step_from']}):")
        for key, value in p["bytes_per_device"].items():
            lines.append(f"  {key:<28}{value / GIB:>10.2f} GiB")
        if "vision" in p:
            v = p["vision"]
            lines.append(f"  (a vision-language step: the tower's {v['patches_per_row']} patches per row; of the above "
                         f"the tower holds params {v['params'] / GIB:.2f}, grads {v['grads'] / GIB:.2f}, optimizer "
                         f"state {v['optimizer_state'] / GIB:.2f} GiB"
                         + ("; train.freeze_text: the text weights have no grads or optimizer state)"
                            if v["freeze_text"] else ")"))
        if "reference_model" in p["bytes_per_device"]:
            held_by = "grpo with grpo.beta > 0" if p["step"]["objective"] == "grpo" else p["step"]["objective"]
            lines.append(f"  (train.objective={held_by}: reference_model is the frozen reference, an fp32 copy of "
                         "the parameters sharded like them)")
        lines.append(f"  fits in {p['device_memory_bytes'] / 1e9:.0f} GB: {'yes' if p['fits'] else 'NO'}")
        lines.append("collective bytes per step per device:")
        for key, value in p["collective_bytes_per_step_per_device"].items():
            lines.append(f"  {key:<28}{value / GIB:>10.2f} GiB")
    if "prediction" in summary:
        lines += render_prediction(summary["prediction"])
    if "search" in summary:
        lines += render_search(summary["search"], _TOP.value)
    if "serve" in summary:
        lines += render_serving(summary["serve"])
    return "\n".join(lines)


def render_prediction(prediction: dict) -> list[str]:
    hw = prediction["hardware"]
    e = hw["efficiency"]
    lines = [f"hardware {hw['name']}: {hw['matmul_tflops']:.0f} TFLOP/s bf16 dense, {hw['hbm_gbps']:.0f} GB/s HBM, "
             f"{hw['memory_gb']:.0f} GB, {hw['intra_node_link']} {hw['intra_node_gbps']:.0f} GB/s, NIC "
             f"{hw['inter_node_gbps']:.0f} GB/s, {hw['devices_per_node']} per node; achievable "
             f"({prediction['efficiency_from']}): matmul "
             f"{e['matmul']:.0%}, HBM {e['hbm']:.0%}, {hw['intra_node_link']} {e['intra_node']:.0%}, "
             f"NIC {e['inter_node']:.0%}"]
    for i, ph in enumerate(prediction["phases"]):
        head = f"phase {i + 1} {ph['name']}: {ph['global_batch']} x {ph['seq_len']} tokens, {ph['steps']} steps"
        if "error" in ph:
            lines.append(f"{head}: cannot run on this mesh: {ph['error']}")
            continue
        pr = ph["prediction"]
        lines.append(f"{head}, mesh {mesh_name(ph['mesh'])} ({ph['devices']} devices)")
        lines.append(f"  memory per device {ph['bytes_per_device']['total'] / GIB:.1f} GiB of "
                     f"{ph['device_memory_bytes'] / 1e9:.0f} GB: {'fits' if ph['fits'] else 'DOES NOT FIT'}")
        flops = pr["flops_per_device"]
        lines.append(f"  matmul FLOPs per device per step {sum(flops.values()) / 1e12:.1f} T (fwd + bwd + remat "
                     "recompute):")
        lines += [f"    {k:<32}{v / 1e12:>10.2f} T" for k, v in flops.items()]
        lines.append(f"  HBM traffic per device per step (non-matmul) "
                     f"{sum(pr['hbm_bytes_per_device'].values()) / 1e9:.1f} GB: "
                     + ", ".join(f"{k} {v / 1e9:.1f}" for k, v in pr["hbm_bytes_per_device"].items()))
        lines.append("  collectives per device per step:")
        for c in pr["collectives"]:
            lines.append(f"    {c['kind']:<15}{c['axis']:<13}{c['link']:<7}{c['bytes'] / GIB:>9.2f} GiB "
                         f"{c['seconds'] * 1e3:>9.1f} ms  {'overlapped' if c['overlapped'] else 'blocking'}"
                         f"  ({c['what']})")
        lines.append(f"  compute {pr['compute_s'] * 1e3:.1f} ms, memory {pr['memory_s'] * 1e3:.1f} ms, blocking "
                     f"collectives {pr['blocking_collectives_s'] * 1e3:.1f} ms, overlapped collectives "
                     f"{pr['overlapped_collectives_s'] * 1e3:.1f} ms")
        lines.append(f"  predicted step {pr['step_s']:.4g} s (no overlap: {pr['step_s_no_overlap']:.4g} s), "
                     f"{pr['tokens_per_s'] / 1e6:.2f}M tokens/s, MFU {pr['mfu']:.1%} "
                     f"({pr['model_flops_per_s_per_device'] / 1e12:.0f} TFLOP/s per device), "
                     f"bound by {pr['bound_by']}")
    run = prediction["run"]
    if run:
        lines.append(f"whole run: {run['tokens_total'] / 1e12:.2f}T tokens in {run['days_total']:.1f} days ("
                     + ", ".join(f"{d:.1f}" for d in run["days_per_phase"]) + " per phase)")
    g = prediction.get("goodput")
    if g:
        lines.append(f"goodput at a node MTBF of {g['node_mtbf_hours']:g} h ({g['nodes']} nodes, "
                     f"{g['persistent_only']['failures_per_day']:.1f} failures/day, restart {g['restart_s'] / 60:g} "
                     f"min, mean step {g['step_s']:.3g} s, stalls {g['save_stall_s']:g} s persistent, "
                     f"{g['local_stall_s']:g} s local; state {g['state_bytes'] / 1e9:.1f} GB: persistent at "
                     f"{g['storage_gbps']:.3g} GB/s writes in {g['write_s']:.3g} s and restores in "
                     f"{g['restore_s']:.3g} s, local at {g['local_disk_gbps']:g} GB/s a node (two copies) in "
                     f"{g['local_write_s']:.3g} s and {g['local_restore_s']:.3g} s): persistent tier only (every "
                     f"{g['every']} steps) {g['persistent_only']['goodput']:.2%}, at Young's interval clamped at its write (every "
                     f"{g['best_every']} steps) {g['persistent_only_at_best_interval']['goodput']:.2%}; with the "
                     f"local tier (every {g['local_every']} steps) {g['with_local_tier']['goodput']:.2%}, at Young's "
                     f"interval for its stall clamped at its write, a divisor of {g['every']} (every "
                     f"{g['best_local_every']} steps) {g['with_local_tier_at_best_interval']['goodput']:.2%}")
        lines.append(f"goodput against the interval (every N steps: persistent only, interval after the clamp at its "
                     f"write / the local tier every N over persistent every {g['every']}): " + ", ".join(
                         f"{r['every']}: {r['persistent_only']:.2%} ({r['persistent_interval_s']:.3g} s)"
                         + ("" if r["with_local_tier"] is None else f" / {r['with_local_tier']:.2%}")
                         for r in g["against_the_interval"]))
    lines.append("overlap assumptions: " + OVERLAP_ASSUMPTIONS)
    return lines


def planned_goodput(config, cfg, prediction: dict, hw) -> dict:
    """Goodput of the whole run (step time: the phases' mean, weighted by their steps) under --node_mtbf_hours;
    each tier's write and restore time from the state's bytes (parameters and optimizer state) and its rate."""
    phases = [ph for ph in prediction["phases"] if "prediction" in ph]
    if len(phases) != len(prediction["phases"]):
        raise app.UsageError("--node_mtbf_hours needs every phase to fit the mesh (see the phases' errors)")
    for flag in (_STORAGE, _LOCAL_DISK):
        if flag.value is not None and flag.value <= 0:
            raise app.UsageError(f"--{flag.name} {flag.value:g}: a rate in GB/s above 0, e.g. 0.5")
    step_s = sum(ph["prediction"]["step_s"] * ph["steps"] for ph in phases) / sum(ph["steps"] for ph in phases)
    devices = phases[0]["devices"]
    nodes = max(1, devices // hw.devices_per_node)
    every = config.checkpoint.every_steps
    local_every = _LOCAL_EVERY.value or config.checkpoint.get("local_every", 0) or 100
    local_stall = _LOCAL_STALL.value if _LOCAL_STALL.value is not None else 2 * _STALL.value
    memory = parameter_memory(cfg, {}, step_shape(config))
    state_bytes = memory["params"] + memory["optimizer_state"]
    storage_gbps = _STORAGE.value or llama3_storage_share_gbps(devices)
    times = tier_seconds(state_bytes, nodes, storage_gbps, _LOCAL_DISK.value)
    best = best_every(step_s, local_stall, nodes, _MTBF.value, times["local_write_s"], divides=every)
    best_persistent = best_every(step_s, _STALL.value, nodes, _MTBF.value, times["write_s"])
    common = dict(step_s=step_s, nodes=nodes, node_mtbf_h=_MTBF.value, restart_s=60 * _RESTART.value,
                  stall_s=_STALL.value, write_s=times["write_s"], restore_s=times["restore_s"])
    local = dict(local_stall_s=local_stall, local_write_s=times["local_write_s"],
                 local_restore_s=times["local_restore_s"])
    return {"node_mtbf_hours": _MTBF.value, "nodes": nodes, "save_stall_s": _STALL.value, "local_stall_s": local_stall,
            "step_s": step_s, "restart_s": 60 * _RESTART.value, "state_bytes": state_bytes,
            "storage_gbps": storage_gbps, "local_disk_gbps": _LOCAL_DISK.value, **times,
            "every": every, "local_every": local_every, "persistent_only": goodput(**common, every=every),
            "best_every": best_persistent, "persistent_only_at_best_interval": goodput(**common, every=best_persistent),
            "with_local_tier": goodput(**common, every=every, local_every=local_every, **local),
            "best_local_every": best, "with_local_tier_at_best_interval": goodput(
                **common, every=every, local_every=best, **local),
            "against_the_interval": against_the_interval(INTERVAL_STEPS, every, local, **common)}


def render_serving(plans: list[dict]) -> list[str]:
    state = plans[0]["state_bytes_per_request"]
    lines = [f"serving one request of {plans[0]['context']} tokens: decode state {state['total'] / 2**20:.1f} MiB "
             f"(KV cache full layers {state['kv_full_layers'] / 2**20:.1f} MiB, sliding layers "
             f"{state['kv_sliding_layers'] / 2**20:.1f} MiB, CCA carry {state['cca_carry'] / 1024:.1f} KiB)"]
    for p in plans:
        lines.append(f"on one {p['hardware']} ({p['memory_bytes'] / 1e9:.0f} GB, {p['reserve_fraction']:.0%} "
                     f"reserved for activations/workspace; achieved HBM {p['achieved_hbm_bytes_per_s'] / 1e9:.0f} "
                     f"GB/s, matmul {p['achieved_matmul_flops_per_s'] / 1e12:.0f} TFLOP/s):")
        for name, f in p["formats"].items():
            w = f["weight_bytes"]
            group = f", group {p['group_size']} scales" if name in MODES else ""
            lines.append(f"  {name} weights{group}: {w['total'] / 1e9:.2f} GB (experts {w['experts'] / 1e9:.2f}, "
                         f"always read {w['always'] / 1e9:.2f}); "
                         + (f"{f['slots']} concurrent requests" if f["slots"] else "not one request fits"))
            if f["decode"]:
                lines.append(f"    {'batch':>6}{'experts/layer':>15}{'GB/step':>9}{'ms/step':>9}{'tokens/s':>10}"
                             "  bound")
            for d in f["decode"]:
                lines.append(f"    {d['batch']:>6}{d['experts_per_layer']:>15.2f}{d['bytes'] / 1e9:>9.2f}"
                             f"{d['step_s'] * 1e3:>9.2f}{d['tokens_per_s']:>10.0f}  {d['bound_by']}")
    lines.append("serving assumptions: " + SERVE_ASSUMPTIONS)
    return lines


def render_search(result: dict, top: int) -> list[str]:
    lines = [f"mesh search on {result['devices']} {result['hardware']} ({result['candidates']} candidate meshes)"]
    for ph in result["phases"]:
        lines.append(f"phase {ph['name']}: {len(ph['ranked'])} feasible; infeasible: "
                     + (", ".join(f"{n} {why}" for why, n in ph["infeasible"].items()) or "none"))
        for r in ph["ranked"][:top]:
            lines.append(f"  {r['mesh']:<40}{r['step_s']:>10.4g} s  MFU {r['mfu']:6.1%}  "
                         f"{r['memory_gib']:6.1f} GiB  bound by {r['bound_by']}")
    if result["whole_run"]:
        best = result["whole_run"][0]
        lines.append(f"fastest mesh for every phase: {best['mesh']} ({best['days']:.1f} days)")
    else:
        lines.append("no single mesh runs every phase: plan each phase's mesh separately")
    return lines


def _step_source(config) -> tuple[int, int, str]:
    """(global batch, sequence length, where they come from) of the step that --mesh plans: the
    config's train.global_batch_size and train.seq_len, else (a curriculum config such as
    configs/demo.py) the phase with the most tokens per step, the one that holds the most. A GRPO
    config's step is its one phase (grpo_batches.grpo_phase), whatever train.seq_len says."""
    train = config.get("train", {})
    if train.get("objective") == "grpo":
        phase, = config_phases(config)
        return phase.global_batch_size, phase.seq_len, ("grpo.prompts_per_step x grpo.num_generations rows of "
                                                        "grpo.max_prompt_length + grpo.max_completion_length - 1")
    if train.get("global_batch_size") is not None and train.get("seq_len") is not None:
        return int(train["global_batch_size"]), int(train["seq_len"]), "train"
    phases = config_phases(config)
    i, p = max(enumerate(phases), key=lambda ip: (ip[1].global_batch_size * ip[1].seq_len, ip[1].seq_len))
    return p.global_batch_size, p.seq_len, f"curriculum phase {i + 1} {p.name}, the most tokens per step"


def step_shape(config) -> StepShape:
    train, mesh = config.get("train", {}), config.get("mesh", {})
    optimizer = _OPTIMIZER.value or config.get("optimizer", {}).get("name", "adamw")
    global_batch, seq_len, _ = _step_source(config)
    return StepShape(global_batch=global_batch, seq_len=seq_len, **grpo_step_fields(config),
                     grad_accum=_ACCUM.value or train.get("microbatches", 1),
                     ns_steps=config.get("optimizer", {}).get("muon_ns_steps", 5),
                     distributed_muon=bool(config.get("optimizer", {}).get("muon_distributed", False)),
                     loss_chunk=train.get("loss_chunk_size", 512), objective=train.get("objective", "lm"),
                     optimizer="muon" if "muon" in optimizer else "adamw", platform=_PLATFORM.value,
                     shard_optimizer_over_data=bool(_ZERO1.value if _ZERO1.value is not None
                                                    else mesh.get("shard_optimizer_over_data", False)),
                     gradient_reduce_dtype=_REDUCE_DTYPE.value or mesh.get("gradient_reduce_dtype", "float32"),
                     vision=vision_config(config)[0] if "vision" in config else None,
                     patch_capacity=train.get("patch_capacity", 0), freeze_text=bool(train.get("freeze_text", False)))


def _nearest_divisors(n: int, k: int) -> list[int]:
    """The divisors of n nearest to k, below and above it."""
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    below, above = [d for d in divisors if d < k], [d for d in divisors if d > k]
    return ([below[-1]] if below else []) + ([above[0]] if above else [])


def _mesh_with(mesh: dict[str, int], axis: str, size: int) -> str:
    return ",".join(f"{a}={n}" for a, n in {**mesh, axis: size}.items() if n > 1 or a == axis)


def check_mesh_fits_step(config, mesh: dict[str, int], shape: StepShape) -> None:
    """A --mesh that cannot split the planned step's batch or sequence: a ConfigError (exit 2) naming
    --mesh, the number that does not divide and where it comes from, and sizes that would."""
    _, _, source = _step_source(config)
    batch_from, seq_from = ("train.global_batch_size", "train.seq_len") if source == "train" else (source, source)
    flag = f"--mesh {_MESH.value}"
    batch, accum = shape.global_batch, shape.grad_accum
    if batch % accum:
        named = f"--grad_accum {accum}" if _ACCUM.value else f"train.microbatches={accum}"
        raise ConfigError(f"{named}: {accum} micro-batches do not divide the global batch of {batch} rows "
                          f"({batch_from})\n"
                          f"fix: --grad_accum with a divisor of {batch}, e.g. "
                          + " or ".join(f"--grad_accum {d}" for d in _nearest_divisors(batch, accum)))
    rows, shards = batch // accum, math.prod(mesh[a] for a in ("data", "fsdp", "expert"))
    if rows % shards:
        split = f" in {accum} micro-batches of {rows}" if accum > 1 else ""
        used = [a for a in ("data", "fsdp", "expert") if mesh[a] > 1]
        if len(used) == 1:
            others = shards // mesh[used[0]]
            sizes = [d // others for d in _nearest_divisors(rows, shards) if d % others == 0]
            examples = " or ".join(f"--mesh {_mesh_with(mesh, used[0], n)}" for n in sizes)
        else:
            examples = " or ".join(f"data*fsdp*expert = {d}" for d in _nearest_divisors(rows, shards))
        raise ConfigError(f"{flag}: the global batch of {batch} rows{split} ({batch_from}) does not split over "
                          f"data*fsdp*expert = {shards}\nfix: batch axes whose product divides {rows}, e.g. {examples}")
    if shape.seq_len % mesh["context"]:
        raise ConfigError(f"{flag}: the sequence length {shape.seq_len} ({seq_from}) does not split over "
                          f"context = {mesh['context']}\nfix: a context size dividing {shape.seq_len}, e.g. "
                          + " or ".join(f"--mesh {_mesh_with(mesh, 'context', n)}"
                                        for n in _nearest_divisors(shape.seq_len, mesh["context"])))


def checked_vision_config(config, planned_mesh: dict[str, int] | None):
    """A vision-language config as the planner plans it: a ConfigError (exit 2) naming --mesh when it has
    context > 1, else the trainer's checks of a vision run (train.settings.check_vision_run: the
    objective, train.patch_capacity, mesh.context), on the config with the mesh's context 1 when the
    planned meshes are not the config's (--mesh, --search). -> the config to plan."""
    if planned_mesh is not None and planned_mesh["context"] != 1:
        raise ConfigError(f"--mesh {_MESH.value}: a vision-language config (it has a vision section) runs on "
                          f"mesh.context = 1 (image tokens attend across the sequence), not {planned_mesh['context']}"
                          f"\nfix: --mesh without context, e.g. --mesh "
                          + _mesh_with({a: n for a, n in planned_mesh.items() if a != "context"}, "data",
                                       planned_mesh["data"] * planned_mesh["context"]))
    if planned_mesh is not None or _SEARCH.value:
        config = config.copy_and_resolve_references()
        config.mesh.context = 1
    settings_from_config(config)
    return config


def check_vision_search(result: dict) -> None:
    """A vision-language --search whose phase no mesh of context 1 runs: a ConfigError naming --devices."""
    for phase in result["phases"]:
        if not phase["ranked"] and VISION_CONTEXT in phase["infeasible"]:
            reasons = ", ".join(f"{n} {why}" for why, n in phase["infeasible"].items())
            raise ConfigError(f"--search --devices {result['devices']}: no mesh of {result['devices']} devices runs "
                              f"phase {phase['name']} of this vision-language config (infeasible: {reasons})\n"
                              "fix: fewer --devices, so that data x fsdp x expert x tensor reaches the count")


def _hardware():
    if _HARDWARE.value is None:
        if _CALIBRATION.value or _SEARCH.value:
            raise app.UsageError("--calibration and --search need --hardware, e.g. --hardware mi300x")
        return None
    hw = PROFILES[_HARDWARE.value]
    return calibrated(hw, _CALIBRATION.value) if _CALIBRATION.value else hw


def _explicit_mesh(devices: int | None) -> tuple[dict[str, int] | None, int | None]:
    """--mesh sizes (None when not given) and the device count (--devices, else the --mesh product)."""
    if not _MESH.value:
        return None, devices
    sizes = parse_mesh_flag(_MESH.value)
    if -1 in sizes.values() and devices is None:
        raise app.UsageError("--mesh for planning needs explicit sizes (no -1), or --devices N")
    devices = devices or math.prod(sizes.values())
    return resolve_mesh_shape(sizes, devices, MESH_FLAG), devices


def plan_phases(config, cfg, hw, cli_mesh, devices: int | None, memory_gb: float) -> dict:
    phases = config_phases(config)
    plans = []
    for phase in phases:
        sizes = phase_mesh(config, phase, cli_mesh)
        if -1 in sizes.values() and devices is None:
            raise app.UsageError("the config's mesh has a -1 axis: pass --devices N or --mesh")
        entry = {"name": phase.name, "seq_len": phase.seq_len, "global_batch": phase.global_batch_size,
                 "steps": phase.num_batches}
        try:
            entry.update(plan_phase(cfg, phase_shape(step_shape(config), phase),
                                    resolve_mesh_shape(sizes, devices or math.prod(sizes.values())), hw, memory_gb))
        except ValueError as e:  # batch or sequence vs the mesh
            entry["error"] = str(e)
        plans.append(entry)
    planned = [(p, r) for p, r in zip(phases, plans) if "error" not in r]
    return {"hardware": dataclasses.asdict(hw), "efficiency_from": _CALIBRATION.value or "assumed", "phases": plans,
            "run": run_time(*zip(*planned)) if len(planned) == len(plans) else None}


def image_size() -> tuple[int, int]:
    try:
        height, width = (int(n) for n in _IMAGE_SIZE.value.lower().split("x"))
    except ValueError:
        height = width = 0
    if min(height, width) < 1:
        raise app.UsageError(f"--image_size {_IMAGE_SIZE.value!r}: give HEIGHTxWIDTH in pixels, e.g. 448x448")
    return height, width


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if _CONFIG.value is None:
        raise app.UsageError("--config is required, e.g. --config configs/zaya1_base.py")
    cfg = model_config(_CONFIG.value)
    vision = vision_config(_CONFIG.value)
    summary = model_summary(cfg) if vision is None else vl_model_summary(cfg, vision[0], image_size())
    hw = _hardware()
    memory_gb = _MEMORY.value or (hw.memory_gb if hw else 192.0)
    if _SERVE.value:
        if _MESH.value or _SEARCH.value:
            raise app.UsageError("--serve plans one GPU: drop --mesh and --search")
        if not 0 <= _RESERVE.value < 1:
            raise app.UsageError(f"--memory_reserve {_RESERVE.value}: a fraction of device memory in [0, 1), e.g. 0.1")
        if _GROUP_SIZE.value < 2 or _GROUP_SIZE.value % 2:
            raise app.UsageError(f"--group_size {_GROUP_SIZE.value}: a positive even number (int4 packs pairs), "
                                 "e.g. 64")
        summary["serve"] = [plan_serving(cfg, p, _CONTEXT.value, _MEMORY.value or p.memory_gb, _RESERVE.value,
                                         _GROUP_SIZE.value) for p in ([hw] if hw else PROFILES.values())]
        print(json.dumps(summary, indent=2) if _JSON.value else render(summary))
        return
    mesh, devices = _explicit_mesh(_DEVICES.value)
    config = _CONFIG.value
    if vision is not None and (mesh or hw or _SEARCH.value):
        config = checked_vision_config(config, mesh)
    if mesh:
        shape = step_shape(config)
        check_mesh_fits_step(config, mesh, shape)
        check_axes_divide(list(parameter_states(cfg, shape.vision).values()), mesh, f"--mesh {_MESH.value}",
                          lambda axis, size: f"--mesh {_mesh_with(mesh, axis, size)}")
        check_mesh(mesh, shape.gradient_reduce_dtype)
        summary["plan"] = plan(cfg, mesh, shape, memory_gb)
        source = _step_source(config)[2]
        summary["plan"]["step_from"] = "train.global_batch_size, train.seq_len" if source == "train" else source
    if _SEARCH.value:
        if devices is None:
            raise app.UsageError("--search needs --devices N (or a --mesh whose product is the device count)")
        summary["search"] = search(cfg, config_phases(config), step_shape(config), devices, hw, memory_gb)
        if vision is not None:
            check_vision_search(summary["search"])
    elif hw:
        summary["prediction"] = plan_phases(config, cfg, hw, mesh, devices, memory_gb)
        if _MTBF.value:
            summary["prediction"]["goodput"] = planned_goodput(config, cfg, summary["prediction"], hw)
    if _MTBF.value and "prediction" not in summary:
        raise app.UsageError("--node_mtbf_hours needs --hardware (and no --search): it uses the predicted step")
    print(json.dumps(summary, indent=2) if _JSON.value else render(summary))


if __name__ == "__main__":
    cli.run(main)
