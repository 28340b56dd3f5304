"""Plan a run before launching it, from an abstract init (nothing is allocated).

  python -m zaya_jax.plan --config configs/zaya1_base.py [--json] [--config.model.num_layers=4]
  python -m zaya_jax.plan --config configs/zaya1_base.py --mesh data=128,fsdp=8 [--device_memory_gb 192]

Always: parameter counts and the KV-cache size. With --mesh: per-device bytes of parameters,
gradients, optimizer state and activations, collective bytes per step by kind, and whether it
fits the device memory (default 192 GB, an MI300X).
"""

from __future__ import annotations

import json
import math

from absl import app, flags
from ml_collections import config_flags

from zaya_jax import cli

from zaya_jax.config_files import model_config
from zaya_jax.model.accounting import model_summary
from zaya_jax.parallel.mesh import parse_mesh_flag, resolve_mesh_shape
from zaya_jax.parallel.planner import GIB, StepShape, plan

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a config file (configs/*.py).")
_JSON = flags.DEFINE_bool("json", False, "Print machine-readable JSON.")
_MESH = flags.DEFINE_string("mesh", None, "Mesh to plan for, e.g. data=128,fsdp=8 (any size; no devices needed).")
_MEMORY = flags.DEFINE_float("device_memory_gb", 192.0, "Device memory in GB (MI300X: 192, H100: 80, H200: 141).")
_ACCUM = flags.DEFINE_integer("grad_accum", None, "Micro-batches per step (default: config train.grad_accum_steps or 1).")
_OPTIMIZER = flags.DEFINE_enum("optimizer", None, ["adamw", "muon"], "Optimizer (default: config optimizer.name).")
_PLATFORM = flags.DEFINE_enum("platform", "gpu", ["gpu", "cpu"], "Target platform (picks the auto MoE backend).")
_ZERO1 = flags.DEFINE_bool("shard_optimizer_over_data", None,
                           "Optimizer state also sharded over data (default: config mesh.shard_optimizer_over_data).")


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
    if "plan" in summary:
        p = summary["plan"]
        mesh = ",".join(f"{a}={n}" for a, n in p["mesh"].items() if n > 1) or "1 device"
        lines.append(f"per device on {mesh} ({p['devices']} devices), {p['remat']} remat, {p['dtype']}:")
        for key, value in p["bytes_per_device"].items():
            lines.append(f"  {key:<28}{value / GIB:>10.2f} GiB")
        lines.append(f"  fits in {p['device_memory_bytes'] / 1e9:.0f} GB: {'yes' if p['fits'] else 'NO'}")
        lines.append("collective bytes per step per device:")
        for key, value in p["collective_bytes_per_step_per_device"].items():
            lines.append(f"  {key:<28}{value / GIB:>10.2f} GiB")
    return "\n".join(lines)


def step_shape(config) -> StepShape:
    train, mesh = config.get("train", {}), config.get("mesh", {})
    optimizer = _OPTIMIZER.value or config.get("optimizer", {}).get("name", "adamw")
    return StepShape(global_batch=train["global_batch_size"], seq_len=train["seq_len"],
                     grad_accum=_ACCUM.value or train.get("grad_accum_steps", 1),
                     optimizer="muon" if "muon" in optimizer else "adamw", platform=_PLATFORM.value,
                     shard_optimizer_over_data=bool(_ZERO1.value if _ZERO1.value is not None
                                                    else mesh.get("shard_optimizer_over_data", False)))


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if _CONFIG.value is None:
        raise app.UsageError("--config is required, e.g. --config configs/zaya1_base.py")
    cfg = model_config(_CONFIG.value)
    summary = model_summary(cfg)
    if _MESH.value:
        sizes = parse_mesh_flag(_MESH.value)
        if -1 in sizes.values():
            raise app.UsageError("--mesh for planning needs explicit sizes (no -1)")
        mesh = resolve_mesh_shape(sizes, math.prod(sizes.values()))
        summary["plan"] = plan(cfg, mesh, step_shape(_CONFIG.value), _MEMORY.value)
    print(json.dumps(summary, indent=2) if _JSON.value else render(summary))


if __name__ == "__main__":
    cli.run(main)
