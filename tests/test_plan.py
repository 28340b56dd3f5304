"""The planner's ZAYA1-base numbers (zaya1-spec: 8.84B / 8.30B / 0.754B, 40 KiB per token)."""

import json
import subprocess
import sys

from zaya_jax.config_files import load_config_file, model_config
from zaya_jax.model.accounting import model_summary


def test_zaya1_base_counts():
    s = model_summary(model_config(load_config_file("configs/zaya1_base.py")))
    assert abs(s["params_total"] - 8.84e9) < 0.01e9
    assert abs(s["params_non_embedding"] - 8.30e9) < 0.01e9
    assert abs(s["params_active_non_embedding"] - 0.754e9) < 0.002e9
    assert s["kv_cache_bytes_per_token"] == 40 * 1024
    assert s["kv_cache_numbers_per_token_per_layer"] == 512
    assert sum(s["breakdown"].values()) == s["params_total"]


def test_plan_cli_json_with_override():
    out = subprocess.run([sys.executable, "-m", "zaya_jax.plan", "--config", "configs/zaya1_base.py", "--json",
                          "--config.model.num_layers=20"], capture_output=True, text=True, check=True,
                         env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})
    s = json.loads(out.stdout)
    assert s["kv_cache_bytes_per_token"] == 20 * 1024


def test_plan_cli_names_a_bad_field():
    out = subprocess.run([sys.executable, "-m", "zaya_jax.plan", "--config", "configs/tiny.py",
                          "--config.model.layout=sideways"], capture_output=True, text=True,
                         env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})
    assert out.returncode != 0 and "model.layout='sideways' does not exist" in out.stderr
