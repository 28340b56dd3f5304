"""Plan a run before launching it: parameter counts and KV-cache size from an abstract init.

  python -m zaya_jax.plan --config configs/zaya1_base.py [--json] [--config.model.num_layers=4]
"""

from __future__ import annotations

import json

from absl import app, flags
from ml_collections import config_flags

from zaya_jax.config_files import model_config
from zaya_jax.model.accounting import model_summary

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a config file (configs/*.py).")
_JSON = flags.DEFINE_bool("json", False, "Print machine-readable JSON.")


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
    return "\n".join(lines)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if _CONFIG.value is None:
        raise app.UsageError("--config is required, e.g. --config configs/zaya1_base.py")
    summary = model_summary(model_config(_CONFIG.value))
    print(json.dumps(summary, indent=2) if _JSON.value else render(summary))


if __name__ == "__main__":
    app.run(main)
