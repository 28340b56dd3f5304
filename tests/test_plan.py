"""The planner's ZAYA1-base numbers (zaya1-spec: 8.84B / 8.30B / 0.754B, 40 KiB per token)."""

import json
import subprocess
import sys

import pytest

from zaya_jax.config_files import load_config_file, model_config
from zaya_jax.model.accounting import model_summary
from zaya_jax.parallel.mesh import resolve_mesh_shape
from zaya_jax.parallel.planner import StepShape, dispatch_numbers_per_layer, plan


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


def test_planner_state_bytes_equal_xla_arguments():
    """Parameters + AdamW state per device, analytic vs XLA's compiled memory analysis."""
    import importlib.util
    import pathlib

    spec = importlib.util.spec_from_file_location("planner_vs_xla", pathlib.Path("benchmarks/planner_vs_xla.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    from zaya_jax.parallel.mesh import make_mesh, parse_mesh_flag, resolve_mesh_shape
    from zaya_jax.parallel.planner import StepShape, plan

    cfg = model_config(load_config_file("configs/tiny.py"))
    flag = "data=2,fsdp=2,expert=2"
    xla = bench.xla_memory(cfg, make_mesh(parse_mesh_flag(flag)), 8, 64)
    ours = plan(cfg, resolve_mesh_shape(parse_mesh_flag(flag), 8), StepShape(8, 64, platform="cpu"))
    state = ours["bytes_per_device"]["params"] + ours["bytes_per_device"]["optimizer_state"]
    batch_bytes = 8 * 64 * 4 / 8
    assert abs(xla["arguments"] - state - batch_bytes) / xla["arguments"] < 0.01


def test_fsdp_gathered_is_one_layer_and_the_embedding_gradient():
    """One layer's weights gathered (bf16) and its unsharded gradient (fp32), plus the embedding's
    fp32 gradient: what the compiled step holds at once (docs/parallel.md), not the whole stack."""
    cfg = model_config(load_config_file("configs/zaya1_base.py"))
    counts = model_summary(cfg)
    mesh = resolve_mesh_shape({"data": 128, "fsdp": 8}, 1024)
    shape = StepShape(4096, 4096, optimizer="muon", shard_optimizer_over_data=True)
    gathered = plan(cfg, mesh, shape)["bytes_per_device"]["fsdp_gathered"]
    layer = counts["params_non_embedding"] / cfg.num_layers
    embedding = counts["params_total"] - counts["params_non_embedding"]
    assert gathered == pytest.approx(layer * (2 + 4) + embedding * 4, rel=0.01)
    assert plan(cfg.replace(num_layers=20), mesh, shape)["bytes_per_device"]["fsdp_gathered"] == pytest.approx(
        gathered, rel=1e-9)
    assert plan(cfg, resolve_mesh_shape({"data": -1}, 1024), shape)["bytes_per_device"]["fsdp_gathered"] == 0


@pytest.mark.parametrize("tensor", [1, 2])
def test_tiles_dispatch_saves_sorted_rows_and_two_pre_activations(tensor):
    """expert_windows keeps x [T+W, D], gate_pre and up_pre [T+W, I] for the backward pass."""
    cfg = model_config(load_config_file("configs/tiny.py")).replace(moe_backend="tiles")
    mesh = resolve_mesh_shape({"data": -1, "tensor": tensor}, 8)
    d, i, w = cfg.hidden_size, cfg.moe_intermediate_size / tensor, cfg.moe_tile_size
    assert dispatch_numbers_per_layer(cfg, 100, mesh, "cpu") == (100 + w) * (d + 2 * i)
