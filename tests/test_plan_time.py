"""The planner's step-time prediction: FLOPs against the parameter counts, links from the device
order, calibration files, the mesh search and the CLI."""

import dataclasses
import json
import math
import subprocess
import sys

import pytest

from zaya_jax.config_files import load_config_file, model_config
from zaya_jax.errors import UserError
from zaya_jax.hardware import PROFILES, calibrated
from zaya_jax.model.accounting import model_summary
from zaya_jax.parallel.mesh import resolve_mesh_shape
from zaya_jax.planner.mesh_search import search
from zaya_jax.planner.phase_plan import config_phases, phase_shape, plan_phase
from zaya_jax.planner.step_plan import StepShape, _parameters, plan
from zaya_jax.planner.step_time import link_of, matmul_flops

ZAYA1 = "configs/zaya1_base.py"


def _zaya1(**model):
    return model_config(load_config_file(ZAYA1)).replace(**model)


def test_layer_flops_are_six_per_active_parameter_and_token():
    """Without remat and with dropless experts, weight matmuls do 2 FLOPs per weight per token
    forward and 4 backward: 6 x the active non-embedding parameters (model_summary, counted from
    the abstract model) per token; the tied loss head 6 x V x D for lm (its gradient computed with
    its forward), 8 x V x D for dpo (its checkpoint recomputes it)."""
    cfg = _zaya1(remat="none")
    counts = model_summary(cfg)
    mesh = resolve_mesh_shape({"data": 1024}, 1024)
    shape = StepShape(4096, 4096, optimizer="adamw", platform="gpu")
    flops = matmul_flops(cfg, mesh, shape, _parameters(cfg, mesh))
    tokens = 4096 * 4096 / 1024
    weights = sum(v for k, v in flops.items() if k not in ("attention/scores", "loss_head", "optimizer/newton_schulz"))
    # not matmuls: norms, biases, scales, temperatures, the depthwise convolution's taps
    assert weights == pytest.approx(6 * tokens * counts["params_active_non_embedding"], rel=0.005)
    assert flops["loss_head"] == pytest.approx(6 * tokens * counts["breakdown"]["embedding (tied)"], rel=1e-9)
    dpo = matmul_flops(cfg, mesh, dataclasses.replace(shape, objective="dpo"), _parameters(cfg, mesh))
    assert dpo["loss_head"] == pytest.approx(8 * tokens * counts["breakdown"]["embedding (tied)"], rel=1e-9)
    assert flops["optimizer/newton_schulz"] == 0


def test_dots_no_batch_recomputes_ragged_experts_and_batched_dots():
    """jax's dots_with_no_batch_dims_saveable saves only dot_generals without batch dimensions:
    ragged_dot (the GPU experts), the attention scores and the grouped convolution run again."""
    mesh = resolve_mesh_shape({"data": 1024}, 1024)
    shape = StepShape(4096, 4096, optimizer="adamw", platform="gpu")
    none = matmul_flops(_zaya1(remat="none"), mesh, shape, _parameters(_zaya1(), mesh))
    dots = matmul_flops(_zaya1(remat="dots_no_batch"), mesh, shape, _parameters(_zaya1(), mesh))
    for name in ("experts", "attention/scores", "attention/convolution"):
        assert dots[name] == pytest.approx(none[name] * 4 / 3)
    for name in ("attention/qk_projections", "attention/output_projection", "router"):
        assert dots[name] == pytest.approx(none[name])


@pytest.mark.parametrize("kernel", ["xla", "pallas"])
def test_kernel_saving_remat_recomputes_only_the_unnamed_batched_ops(kernel):
    """dots_no_batch_and_kernels saves the expert matmul outputs and the flash kernel's output and
    logsumexp: the experts (and the flash scores) run no extra pass; the grouped convolution and
    the XLA path's scores still do."""
    mesh = resolve_mesh_shape({"data": 1024}, 1024)
    shape = StepShape(4096, 4096, optimizer="adamw", platform="gpu")
    none, dots, kernels = (matmul_flops(_zaya1(remat=r, attention_kernel=kernel), mesh, shape, _parameters(_zaya1(), mesh))
                           for r in ("none", "dots_no_batch", "dots_no_batch_and_kernels"))
    assert kernels["experts"] == pytest.approx(none["experts"]) and dots["experts"] > none["experts"]
    assert kernels["attention/convolution"] == pytest.approx(dots["attention/convolution"])
    scores = kernels["attention/scores"] / none["attention/scores"]
    assert scores == pytest.approx(1.0 if kernel == "pallas" else 4 / 3)


def test_links_follow_the_device_order():
    """Devices fill the mesh with the last axis fastest; 8 consecutive devices share a node."""
    assert link_of("data", resolve_mesh_shape({"data": 1024}, 1024), 8) == ("inter_node", 8)
    mesh = resolve_mesh_shape({"data": 128, "fsdp": 8}, 1024)
    assert link_of("fsdp", mesh, 8) == ("intra_node", 8)
    assert link_of("data", mesh, 8) == ("inter_node", 1)
    mesh = resolve_mesh_shape({"data": 64, "expert": 4, "tensor": 2}, 512)
    assert link_of("tensor", mesh, 8) == ("intra_node", 2)
    assert link_of("expert", mesh, 8) == ("intra_node", 4)
    assert link_of("data", mesh, 8) == ("inter_node", 1)


def _phase1(hw, **model):
    config = load_config_file(ZAYA1)
    phase = config_phases(config)[0]
    shape = phase_shape(StepShape(1, 1, optimizer="muon", shard_optimizer_over_data=True), phase)
    return plan_phase(_zaya1(**model), shape, resolve_mesh_shape({"data": 1024}, 1024), hw, hw.memory_gb)


def test_calibration_file_replaces_the_assumed_rates(tmp_path):
    base = PROFILES["mi300x"]
    path = tmp_path / "rates.json"
    path.write_text(json.dumps({"device_kind": "AMD Instinct MI300X", "matmul_tflops": 500.0, "inter_node_gbps": 25.0}))
    hw = calibrated(base, str(path))
    assert hw.efficiency.matmul == pytest.approx(500.0 / 1307.4)
    assert hw.efficiency.hbm == base.efficiency.hbm
    ours, theirs = _phase1(base)["prediction"], _phase1(hw)["prediction"]
    flops = sum(theirs["flops_per_device"].values())
    assert theirs["compute_s"] == pytest.approx(flops / 500e12)
    assert ours["compute_s"] == pytest.approx(flops / (1307.4e12 * base.efficiency.matmul))
    nic = [c for c in theirs["collectives"] if c["link"] == "NIC"]
    assert nic and all(c["seconds"] == pytest.approx(c["bytes"] / 8 / 25e9) for c in nic)  # 8 data members per node
    assert theirs["mfu"] < ours["mfu"]


@pytest.mark.parametrize("content, message", [
    ({"device_kind": "NVIDIA H100 80GB HBM3", "matmul_tflops": 700}, "device_kind"),
    ({"device_kind": "AMD Instinct MI300X", "matmul_tflop": 700}, "unknown field(s) ['matmul_tflop']"),
    ({"device_kind": "AMD Instinct MI300X", "hbm_gbps": -3}, "hbm_gbps must be a positive number"),
    ([1, 2], "expected a JSON object"),
])
def test_calibration_file_mistakes_name_the_field(tmp_path, content, message):
    path = tmp_path / "rates.json"
    path.write_text(json.dumps(content))
    with pytest.raises(UserError, match="--calibration") as e:
        calibrated(PROFILES["mi300x"], str(path))
    assert message in str(e.value)


@pytest.mark.parametrize("name", ["h200", "mi300x"])
def test_intra_node_collectives_take_bytes_over_the_scale_up_links_rate(name):
    """On data=128,fsdp=4,tensor=2 (1,024 GPUs, 8 per node) the FSDP gathers and reduce-scatters and the
    tensor all-reduces stay inside a node: each takes its bytes / (the profile's scale-up link rate x its
    achievable fraction), and the step's collective totals add those times up. Data-parallel traffic
    (one member per node) takes its bytes / (NIC rate x fraction)."""
    hw = PROFILES[name]
    peaks = {"h200": ("NVLink", 450.0, 0.80, 50.0, 0.80), "mi300x": ("xGMI", 448.0, 0.70, 50.0, 0.80)}[name]
    assert (hw.intra_node_link, hw.intra_node_gbps, hw.efficiency.intra_node, hw.inter_node_gbps,
            hw.efficiency.inter_node) == peaks
    intra_rate = hw.intra_node_gbps * 1e9 * hw.efficiency.intra_node
    nic_rate = hw.inter_node_gbps * 1e9 * hw.efficiency.inter_node
    config = load_config_file(ZAYA1)
    shape = phase_shape(StepShape(1, 1, optimizer="muon"), config_phases(config)[0])
    mesh = resolve_mesh_shape({"data": 128, "fsdp": 4, "tensor": 2}, 1024)
    pred = plan_phase(_zaya1(), shape, mesh, hw, hw.memory_gb)["prediction"]
    rows = pred["collectives"]
    intra = [c for c in rows if c["link"] == hw.intra_node_link]
    assert {(c["kind"], c["axis"]) for c in intra} >= {("all_gather", "fsdp"), ("reduce_scatter", "fsdp"),
                                                      ("all_reduce", "tensor")}
    for c in intra:
        assert c["bytes"] > 1e6 and c["seconds"] == pytest.approx(c["bytes"] / intra_rate, rel=1e-12), c
    nic = [c for c in rows if c["link"] == "NIC"]
    assert nic and all(c["axis"] == "data" for c in nic)
    for c in nic:
        assert c["seconds"] == pytest.approx(c["bytes"] / nic_rate, rel=1e-12), c
    assert pred["blocking_collectives_s"] + pred["overlapped_collectives_s"] == pytest.approx(
        sum(c["bytes"] for c in intra) / intra_rate + sum(c["bytes"] for c in nic) / nic_rate, rel=1e-12)
    assert pred["blocking_collectives_s"] >= sum(c["bytes"] for c in intra if c["axis"] == "tensor") / intra_rate > 0


def test_prediction_adds_up():
    pred = _phase1(PROFILES["mi300x"])["prediction"]
    busy = pred["compute_s"] + pred["memory_s"]
    assert pred["step_s"] == pytest.approx(busy + pred["blocking_collectives_s"]
                                           + max(0.0, pred["overlapped_collectives_s"] - busy))
    assert busy <= pred["step_s"] <= pred["step_s_no_overlap"]
    assert pred["tokens_per_s"] * pred["step_s"] == pytest.approx(4096 * 4096)
    assert pred["bound_by"] in ("compute", "memory") or "over" in pred["bound_by"]


def test_search_ranks_feasible_meshes_and_counts_the_rest():
    config = load_config_file("configs/tiny.py")
    config.train.global_batch_size = 4  # meshes with data*fsdp*expert = 8 cannot split it
    cfg = model_config(config)
    phases = config_phases(config)
    base = StepShape(4, 64, optimizer="muon", platform="gpu")
    hw = PROFILES["h100"]
    result = search(cfg, phases, base, 8, hw, 80.0)
    entry = result["phases"][0]
    assert entry["infeasible"].get("batch or sequence does not split", 0) > 0
    assert len(entry["ranked"]) + sum(entry["infeasible"].values()) == result["candidates"]
    times = [r["step_s"] for r in entry["ranked"]]
    assert times == sorted(times) or all(round(a, 4) <= round(b, 4) for a, b in zip(times, times[1:]))
    best = entry["ranked"][0]
    sizes = dict(part.split("=") for part in best["mesh"].split(","))
    again = plan_phase(cfg, phase_shape(base, phases[0]), resolve_mesh_shape({k: int(v) for k, v in sizes.items()}, 8),
                       hw, 80.0)
    assert again["prediction"]["step_s"] == pytest.approx(best["step_s"])
    with pytest.raises(ValueError, match="not divisible"):
        plan_phase(cfg, phase_shape(base, phases[0]), resolve_mesh_shape({"data": 8}, 8), hw, 80.0)
    assert math.prod(int(v) for v in sizes.values()) == 8


def test_plan_cli_predicts_every_phase():
    out = subprocess.run([sys.executable, "-m", "zaya_jax.planner", "--config", ZAYA1, "--mesh", "data=1024",
                          "--hardware", "mi300x", "--json"], capture_output=True, text=True, check=True,
                         env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})
    phases = json.loads(out.stdout)["prediction"]["phases"]
    assert [p["seq_len"] for p in phases] == [4096, 4096, 32768]
    assert phases[0]["prediction"]["hardware"] == "mi300x" and phases[0]["fits"]
    assert "global_batch_size 512 is not divisible" in phases[2]["error"]  # 512 sequences on 1,024 devices


def test_search_ranks_context_parallel_meshes_for_the_flash_kernel():
    config = load_config_file("configs/tiny.py")
    cfg = model_config(config).replace(attention_kernel="pallas")
    result = search(cfg, config_phases(config), StepShape(8, 64, platform="gpu"), 8, PROFILES["h100"], 80.0)
    assert any("context" in r["mesh"] for r in result["phases"][0]["ranked"])


def test_flash_kernel_context_plan_counts_the_zigzag_permutes():
    """Pallas attention on context=2: each full layer permutes half the local queries there and half
    the outputs back, forward and backward (2 x the local queries' bytes); sliding layers and the
    XLA path permute nothing."""
    cfg = model_config(load_config_file("configs/tiny.py")).replace(attention_kernel="pallas")
    mesh, shape = resolve_mesh_shape({"data": 4, "context": 2}, 8), StepShape(8, 64, platform="gpu")
    queries = 8 * 64 / 8 * cfg.num_q_heads * cfg.head_dim * (2 if cfg.dtype == "bfloat16" else 4)

    def permuted(cfg):
        return plan(cfg, mesh, shape)["collective_bytes_per_step_per_device"]["collective_permute"]
    assert permuted(cfg) == cfg.num_layers * 2 * queries > 0
    assert permuted(cfg.replace(layer_types=("hybrid_sliding",) + ("hybrid",) * (cfg.num_layers - 1),
                                sliding_window=16)) == (cfg.num_layers - 1) * 2 * queries
    assert permuted(cfg.replace(attention_kernel="xla")) == 0


def test_a_dpo_step_also_moves_the_reference_models_bytes():
    """The reference model's HBM traffic, against the model's own parameter count (fp32, replicated
    over `data`) and the pass counts of the docstring: with remat 'none' an LM step's activation
    traffic is 3 passes (forward, backward twice) and its logits 4 trips (logits and their gradient,
    each written and read: the fused loss head), a DPO step's own logits 6 (recomputed); the reference
    runs 1 pass of each and reads its parameters once per micro-batch."""
    import dataclasses
    import jax
    from zaya_jax.model.build import abstract_model
    from zaya_jax.checkpoints.model_parts import ModelParts
    cfg = model_config(load_config_file("configs/tiny.py"))
    assert cfg.remat == "none"
    mesh = resolve_mesh_shape({"data": 2}, 2)
    lm_shape = StepShape(global_batch=8, seq_len=64, grad_accum=2, loss_chunk=32)
    lm, dpo = (plan_phase(cfg, shape, mesh, PROFILES["mi300x"], 192.0)["prediction"]
               for shape in (lm_shape, dataclasses.replace(lm_shape, objective="dpo")))
    lm_bytes, dpo_bytes = lm["hbm_bytes_per_device"], dict(dpo["hbm_bytes_per_device"])
    reference = dpo_bytes.pop("reference_model")
    assert dpo_bytes.pop("loss_logits") == pytest.approx(lm_bytes["loss_logits"] / 4 * 6)
    assert dpo_bytes == {k: v for k, v in lm_bytes.items() if k != "loss_logits"}
    numel = sum(math.prod(a.shape) for a in jax.tree.leaves(ModelParts.arrays(abstract_model(cfg))[0]))
    assert reference == pytest.approx(2 * 4 * numel + lm_bytes["activations"] / 3 + lm_bytes["loss_logits"] / 4 * 2)
    extra = reference + lm_bytes["loss_logits"] / 4 * 2  # the reference, and the recomputed logits
    assert dpo["memory_s"] == pytest.approx(lm["memory_s"] + extra / PROFILES["mi300x"].achieved()["hbm_bytes"])


@pytest.mark.parametrize("name, fp8_peak", [("mi300x", 2614.9), ("h200", 1978.9)])
def test_fp8_recipe_runs_the_projections_and_experts_at_the_fp8_rate(name, fp8_peak):
    """model.matmul_precision=fp8: the FP8 groups' FLOPs (CCA q/k, v, o projections and the
    experts: the same FLOPs as bf16's) move from the bf16 rate to the datasheet FP8 peak times
    the same efficiency; every other group and the memory time stay; a GPU without FP8 is refused."""
    hw = PROFILES[name]
    bf16, fp8 = (_phase1(hw, matmul_precision=p)["prediction"] for p in ("default", "fp8"))
    groups = ("attention/qk_projections", "attention/value_projections", "attention/output_projection", "experts")
    assert fp8["flops_per_device"] == bf16["flops_per_device"]
    moved = sum(bf16["flops_per_device"][g] for g in groups)
    assert fp8["fp8_matmul_flops_per_device"] == pytest.approx(moved) and moved > 0
    efficiency = hw.efficiency.matmul
    expected = bf16["compute_s"] - moved / (hw.matmul_tflops * 1e12 * efficiency) + moved / (fp8_peak * 1e12 * efficiency)
    assert fp8["compute_s"] == pytest.approx(expected)
    assert fp8["memory_s"] == bf16["memory_s"] and fp8["step_s"] < bf16["step_s"]
    with pytest.raises(UserError, match="^model.matmul_precision='fp8': a100 has no FP8 matmuls"):
        _phase1(PROFILES["a100"], matmul_precision="fp8")
