"""The planner's ZAYA1-base numbers (zaya1-spec: 8.84B / 8.30B / 0.754B, 40 KiB per token)."""

import json
import subprocess
import sys

import pytest

from zaya_jax.config_files import load_config_file, model_config
from zaya_jax.model.accounting import model_summary
from zaya_jax.parallel.mesh import resolve_mesh_shape
from zaya_jax.planner.goodput import best_interval_s, goodput
from zaya_jax.planner.step_plan import StepShape, dispatch_numbers_per_layer, plan


def test_zaya1_base_counts():
    s = model_summary(model_config(load_config_file("configs/zaya1_base.py")))
    assert abs(s["params_total"] - 8.84e9) < 0.01e9
    assert abs(s["params_non_embedding"] - 8.30e9) < 0.01e9
    assert abs(s["params_active_non_embedding"] - 0.754e9) < 0.002e9
    assert s["kv_cache_bytes_per_token"] == 40 * 1024
    assert s["kv_cache_numbers_per_token_per_layer"] == 512
    assert sum(s["breakdown"].values()) == s["params_total"]


def test_plan_cli_json_with_override():
    out = subprocess.run([sys.executable, "-m", "zaya_jax.planner", "--config", "configs/zaya1_base.py", "--json",
                          "--config.model.num_layers=20"], capture_output=True, text=True, check=True,
                         env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})
    s = json.loads(out.stdout)
    assert s["kv_cache_bytes_per_token"] == 20 * 1024


def test_plan_cli_names_a_bad_field():
    out = subprocess.run([sys.executable, "-m", "zaya_jax.planner", "--config", "configs/tiny.py",
                          "--config.model.layout=sideways"], capture_output=True, text=True,
                         env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})
    assert out.returncode != 0 and "model.layout='sideways' does not exist" in out.stderr


def _plan_cli(*args) -> subprocess.CompletedProcess:
    from tests.train_helpers import REPO, cli_env

    return subprocess.run([sys.executable, "-m", "zaya_jax.planner", *args], cwd=REPO, env=cli_env(),
                          capture_output=True, text=True, timeout=300)


def _assert_user_error(done, *fragments):
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr[-3000:]
    assert lines and lines[0].startswith("error: ") and len(lines) <= 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    for fragment in fragments:
        assert fragment in done.stderr, (fragment, done.stderr)


@pytest.mark.parametrize("args,fragments", [
    # configs/demo.py has no train.global_batch_size: its curriculum phases give the batch (8 rows)
    (("--config", "configs/demo.py", "--mesh", "data=3"),
     ("--mesh data=3", "global batch of 8 rows", "curriculum phase 3 long_mixed", "data*fsdp*expert = 3",
      "--mesh data=2 or --mesh data=4")),
    (("--config", "configs/zaya1_base.py", "--mesh", "data=3"),
     ("--mesh data=3", "global batch of 4096 rows (train.global_batch_size)", "--mesh data=2 or --mesh data=4")),
    (("--config", "configs/zaya1_base.py", "--mesh", "data=2,context=3"),
     ("--mesh data=2,context=3", "sequence length 4096 (train.seq_len)", "--mesh data=2,context=4")),
    (("--config", "configs/demo.py", "--mesh", "data=2", "--grad_accum", "3"),
     ("--grad_accum 3", "do not divide the global batch of 8 rows", "--grad_accum 2 or --grad_accum 4")),
    (("--config", "configs/demo.py", "--mesh", "data=two"), ("--mesh", "'data'", "integer")),
    # a mesh axis that does not divide a parameter dimension it shards (ZAYA1's 8 + 2 q|k heads, 16 experts)
    (("--config", "configs/zaya1_base.py", "--mesh", "data=2,tensor=3"),
     ("--mesh data=2,tensor=3: tensor=3 does not divide qk_heads = 10", "q_heads = 8", "so tensor must be 1 or 2",
      "fix: --mesh data=2,tensor=2")),
    (("--config", "configs/zaya1_base.py", "--mesh", "data=2,tensor=32"),
     ("--mesh data=2,tensor=32: tensor=32 does not divide", "so tensor must be 1 or 2", "fix: --mesh data=2,tensor=2")),
    (("--config", "configs/zaya1_base.py", "--mesh", "expert=32"),
     ("--mesh expert=32: expert=32 does not divide experts = 16", "so expert must be 1, 2, 4, 8 or 16",
      "fix: --mesh expert=16")),
])
def test_plan_cli_mesh_that_does_not_split_the_step(args, fragments):
    _assert_user_error(_plan_cli(*args), *fragments)


def test_plan_cli_mesh_on_a_curriculum_config_plans_its_largest_phase():
    """configs/demo.py (batch and length per curriculum phase, none in train): --mesh data=2 plans the
    phase with the most tokens per step (8 x 256), and the hardware prediction and search run too."""
    done = _plan_cli("--config", "configs/demo.py", "--mesh", "data=2", "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    p = json.loads(done.stdout)["plan"]
    assert (p["step"]["global_batch"], p["step"]["seq_len"], p["devices"]) == (8, 256, 2)
    assert "long_mixed" in p["step_from"]
    for args in (("--mesh", "data=2", "--hardware", "h200"), ("--search", "--devices", "8", "--hardware", "h200")):
        done = _plan_cli("--config", "configs/demo.py", "--json", *args)
        assert done.returncode == 0, (args, done.stderr[-3000:])


def test_planner_state_bytes_equal_xla_arguments():
    """Parameters + AdamW state per device, analytic vs XLA's compiled memory analysis."""
    import importlib.util
    import pathlib

    spec = importlib.util.spec_from_file_location("planner_vs_xla", pathlib.Path("benchmarks/planner_vs_xla.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    from zaya_jax.parallel.mesh import make_mesh, parse_mesh_flag, resolve_mesh_shape
    from zaya_jax.planner.step_plan import StepShape, plan

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


def test_plan_search_with_bf16_gradient_reduction_leaves_out_the_meshes_the_trainer_refuses():
    done = _plan_cli("--config", "configs/demo.py", "--search", "--devices", "8", "--hardware", "h200", "--json",
                     "--gradient_reduce_dtype", "bfloat16")
    assert done.returncode == 0, done.stderr[-3000:]
    phases = json.loads(done.stdout)["search"]["phases"]
    for phase in phases:
        assert phase["infeasible"]["mesh.gradient_reduce_dtype refuses it"] > 0
        for row in phase["ranked"]:
            sizes = dict(part.split("=") for part in row["mesh"].split(",")) if "=" in row["mesh"] else {}
            assert "data" not in sizes or len(sizes) <= 2, row["mesh"]
    done = _plan_cli("--config", "configs/demo.py", "--mesh", "data=2,fsdp=2,tensor=2", "--gradient_reduce_dtype",
                     "bfloat16")
    _assert_user_error(done, "mesh.gradient_reduce_dtype='bfloat16' runs on data with at most one other axis > 1")


def test_goodput_is_the_first_order_failure_model_by_hand():
    # 10 nodes at 100 h each: a failure every 36,000 s; each costs 360 s of restart plus half the
    # restoring tier's interval (local: 10 steps of 1 s -> 5 s; persistent: 100 -> 50 s)
    local = goodput(step_s=1, nodes=10, node_mtbf_h=100, restart_s=360, every=100, stall_s=1, local_every=10,
                    local_stall_s=2)
    assert local["failure_overhead"] == pytest.approx(365 / 36000)
    assert local["save_overhead"] == pytest.approx(1 / 100 + 2 / 10)
    assert local["goodput"] == pytest.approx(1 - 0.21 - 365 / 36000)
    plain = goodput(step_s=1, nodes=10, node_mtbf_h=100, restart_s=360, every=100, stall_s=1)
    assert plain["goodput"] == pytest.approx(1 - 0.01 - 410 / 36000) and plain["failures_per_day"] == pytest.approx(2.4)
    assert best_interval_s(2, 10, 100) == pytest.approx((2 * 2 * 36000) ** 0.5)
