"""The planner's ZAYA1-base numbers (zaya1-spec: 8.84B / 8.30B / 0.754B, 40 KiB per token)."""

import json
import subprocess
import sys

import pytest

from zaya_jax.config_files import load_config_file, model_config
from zaya_jax.model.accounting import model_summary
from zaya_jax.parallel.mesh import resolve_mesh_shape
from zaya_jax.planner.goodput import (against_the_interval, best_every, best_interval_s, goodput, llama3_node_mtbf_h,
                                      llama3_storage_share_gbps, tier_seconds)
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

    spec = importlib.util.spec_from_file_location("planner_vs_xla", pathlib.Path("benchmarks/planner/planner_vs_xla.py"))
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


# The goodput model by hand (zaya_jax/planner/goodput.py's formula): a failure every
# 36,000 s (10 nodes at 100 h each), each costing the restart, the restoring tier's read, and the
# work since its newest committed save: half its interval plus its write.
FAILURE_EVERY_S = 36000


def test_goodput_is_the_first_order_failure_model_by_hand():
    plain = goodput(step_s=1, nodes=10, node_mtbf_h=100, restart_s=360, every=100, stall_s=1, write_s=30,
                    restore_s=120)
    # saves: 1 s every 100 s; failure: 360 restart + 120 read + 100/2 + 30 in flight
    assert plain["save_overhead"] == pytest.approx(0.01)
    assert plain["lost_per_failure_s"] == pytest.approx(80)
    assert plain["goodput"] == pytest.approx(1 - 0.01 - (360 + 120 + 80) / FAILURE_EVERY_S)
    assert plain["failures_per_day"] == pytest.approx(2.4)
    local = goodput(step_s=1, nodes=10, node_mtbf_h=100, restart_s=360, every=100, stall_s=1, write_s=30,
                    restore_s=120, local_every=10, local_stall_s=2, local_write_s=4, local_restore_s=6)
    # saves: 1/100 + 2/10; failure restores the local step: 360 + 6 + 10/2 + 4
    assert local["save_overhead"] == pytest.approx(0.21)
    assert local["goodput"] == pytest.approx(1 - 0.21 - (360 + 6 + 9) / FAILURE_EVERY_S)
    # no write, no read: the restart alone, half the interval lost
    bare = goodput(step_s=2, nodes=10, node_mtbf_h=100, restart_s=360, every=50, stall_s=1)
    assert bare["goodput"] == pytest.approx(1 - 1 / 100 - (360 + 50) / FAILURE_EVERY_S)


def test_goodput_clamps_each_interval_at_its_write():
    # persistent every 10 steps of 1 s but its write takes 30 s: it saves every 30 s, loses 15 + 30
    slow = goodput(step_s=1, nodes=10, node_mtbf_h=100, restart_s=360, every=10, stall_s=1, write_s=30,
                   restore_s=120)
    assert slow["interval_s"] == 30 and slow["save_overhead"] == pytest.approx(1 / 30)
    assert slow["goodput"] == pytest.approx(1 - 1 / 30 - (360 + 120 + 15 + 30) / FAILURE_EVERY_S)
    # the local tier every 3 steps, its write 8 s: every 8 s, loses 4 + 8; the persistent tier (every
    # 40 steps, write 30 s) is not clamped
    local = goodput(step_s=1, nodes=10, node_mtbf_h=100, restart_s=360, every=40, stall_s=1, write_s=30,
                    restore_s=120, local_every=3, local_stall_s=0.5, local_write_s=8, local_restore_s=6)
    assert (local["interval_s"], local["local_interval_s"]) == (40, 8)
    assert local["goodput"] == pytest.approx(1 - 1 / 40 - 0.5 / 8 - (360 + 6 + 4 + 8) / FAILURE_EVERY_S)
    # Young's interval sqrt(2 x stall x job MTBF), never under the write
    assert best_interval_s(2, 10, 100) == pytest.approx((2 * 2 * FAILURE_EVERY_S) ** 0.5)
    assert best_interval_s(2, 10, 100, write_s=1000) == 1000
    assert best_interval_s(2, 10, 100, write_s=100) == pytest.approx((2 * 2 * FAILURE_EVERY_S) ** 0.5)


def test_a_local_tier_that_restores_faster_raises_goodput_where_it_should():
    # persistent: write and read 300 s each (shared storage); local: write 4 s, read 2 s, stall 0.2 s
    common = dict(step_s=1, nodes=10, node_mtbf_h=100, restart_s=360, every=1000, stall_s=1, write_s=300,
                  restore_s=300)
    plain = goodput(**common)
    local = goodput(**common, local_every=100, local_stall_s=0.2, local_write_s=4, local_restore_s=2)
    assert plain["goodput"] == pytest.approx(1 - 1 / 1000 - (360 + 300 + 500 + 300) / FAILURE_EVERY_S)
    assert local["goodput"] == pytest.approx(1 - 1 / 1000 - 0.2 / 100 - (360 + 2 + 50 + 4) / FAILURE_EVERY_S)
    assert local["goodput"] > plain["goodput"]
    # the same tier restoring as slowly as the persistent one, and stalling 10 s: it lowers goodput
    worse = goodput(**common, local_every=100, local_stall_s=10, local_write_s=300, local_restore_s=300)
    assert worse["goodput"] == pytest.approx(1 - 1 / 1000 - 10 / 300 - (360 + 300 + 150 + 300) / FAILURE_EVERY_S)
    assert worse["goodput"] < plain["goodput"]


def test_goodput_against_the_interval_rows_by_hand():
    # persistent: stall 1 s, write 30 s, read 120 s; local: stall 0.5 s, write 8 s, read 6 s; persistent every 40
    common = dict(step_s=1, nodes=10, node_mtbf_h=100, restart_s=360, stall_s=1, write_s=30, restore_s=120)
    local = dict(local_stall_s=0.5, local_write_s=8, local_restore_s=6)
    rows = {r["every"]: r for r in against_the_interval((4, 7, 40), 40, local, **common)}
    clamped = 1 - 1 / 30 - (360 + 120 + 15 + 30) / FAILURE_EVERY_S  # every 4 or 7 steps: every 30 s, its write
    assert rows[4]["persistent_only"] == pytest.approx(clamped, abs=5e-5) and rows[4]["persistent_interval_s"] == 30
    assert rows[7]["persistent_only"] == pytest.approx(clamped, abs=5e-5)
    # local every 4 steps: every 8 s (its write), losing 4 + 8; 7 does not divide 40: no local row
    assert rows[4]["with_local_tier"] == pytest.approx(1 - 1 / 40 - 0.5 / 8 - (360 + 6 + 4 + 8) / FAILURE_EVERY_S,
                                                       abs=5e-5)
    assert rows[4]["local_interval_s"] == 8 and rows[7]["with_local_tier"] is None
    assert rows[40]["persistent_only"] == pytest.approx(1 - 1 / 40 - (360 + 120 + 20 + 30) / FAILURE_EVERY_S, abs=5e-5)
    assert rows[40]["with_local_tier"] == pytest.approx(
        1 - 1 / 40 - 0.5 / 40 - (360 + 6 + 20 + 8) / FAILURE_EVERY_S, abs=5e-5)
    # Young's sqrt(2 x 2 x 36,000) = 379.5 s: 190 steps of 2 s; a divisor of 1000 at most that: 125; of 100: 100
    assert best_every(2, 2, 10, 100) == 190
    assert (best_every(2, 2, 10, 100, divides=1000), best_every(2, 2, 10, 100, divides=100)) == (125, 100)
    # a 1000 s write: 500 steps
    assert best_every(2, 2, 10, 100, write_s=1000) == best_every(2, 2, 10, 100, write_s=1000, divides=1000) == 500


def test_tier_seconds_from_the_state_and_the_rates():
    # 1 TB over 100 GB/s of storage: 10 s each way; over 100 nodes at 2 GB/s: 10 GB a node, 5 s a copy
    t = tier_seconds(1e12, 100, 100.0, 2.0)
    assert t == pytest.approx({"write_s": 10, "restore_s": 10, "local_write_s": 10, "local_restore_s": 5})
    assert llama3_storage_share_gbps(1024) == pytest.approx(2000 * 1024 / 16384)
    assert llama3_node_mtbf_h() == pytest.approx(54 * 24 * 2048 / 419)


def test_plan_cli_goodput_writes_and_restores_from_the_state_and_the_rates():
    done = _plan_cli("--config", "configs/zaya1_base.py", "--hardware", "mi300x", "--devices", "1024", "--json",
                     "--node_mtbf_hours", "6000", "--local_disk_gbps", "0.25", "--restart_minutes", "5")
    assert done.returncode == 0, done.stderr[-3000:]
    g = json.loads(done.stdout)["prediction"]["goodput"]
    s = model_summary(model_config(load_config_file("configs/zaya1_base.py")))
    # float32 parameters, Muon's one momentum for every matrix and AdamW's two moments for the
    # embedding and the norms (the rest of the non-matrix parameters are a few MB)
    b = s["breakdown"]
    assert g["state_bytes"] == pytest.approx(4 * (2 * s["params_total"] + b["embedding (tied)"]
                                                  + b["norms + residual scaling"]), rel=0.002)
    assert g["nodes"] == 128 and g["storage_gbps"] == pytest.approx(125.0)
    assert g["write_s"] == pytest.approx(g["state_bytes"] / 125e9)
    assert g["local_write_s"] == pytest.approx(2 * g["state_bytes"] / 128 / 0.25e9)
    assert g["local_restore_s"] == pytest.approx(g["state_bytes"] / 128 / 0.25e9)
    interval = max(g["every"] * g["step_s"], g["write_s"])
    failures_per_s = 128 / (6000 * 3600)
    assert g["persistent_only"]["goodput"] == pytest.approx(
        1 - 2 / interval - failures_per_s * (300 + g["restore_s"] + interval / 2 + g["write_s"]))
    local_interval = max(g["local_every"] * g["step_s"], g["local_write_s"])
    assert g["with_local_tier"]["goodput"] == pytest.approx(
        1 - 2 / interval - 4 / local_interval
        - failures_per_s * (300 + g["local_restore_s"] + local_interval / 2 + g["local_write_s"]))
    assert g["best_local_every"] <= g["every"] and g["every"] % g["best_local_every"] == 0
    rows = {r["every"]: r for r in g["against_the_interval"]}
    assert rows[100]["with_local_tier"] == pytest.approx(
        1 - 2 / interval - 4 / max(100 * g["step_s"], g["local_write_s"])
        - failures_per_s * (300 + g["local_restore_s"] + max(100 * g["step_s"], g["local_write_s"]) / 2
                            + g["local_write_s"]), abs=5e-5)
    assert rows[2000]["with_local_tier"] is None
    text = _plan_cli("--config", "configs/zaya1_base.py", "--hardware", "mi300x", "--devices", "1024",
                     "--node_mtbf_hours", "6000", "--local_disk_gbps", "0.25", "--restart_minutes", "5")
    assert text.returncode == 0, text.stderr[-3000:]
    assert (f"100: {rows[100]['persistent_only']:.2%} ({rows[100]['persistent_interval_s']:.3g} s) / "
            f"{rows[100]['with_local_tier']:.2%}, 200:") in text.stdout
    _assert_user_error(_plan_cli("--config", "configs/zaya1_base.py", "--hardware", "mi300x", "--devices", "1024",
                                 "--node_mtbf_hours", "6000", "--storage_gbps", "-1"),
                       "--storage_gbps -1: a rate in GB/s above 0")
