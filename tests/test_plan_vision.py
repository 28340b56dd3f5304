"""The planner's vision-language step plan against what the trainer builds for the tiny VL config of
tests/test_vision_training.py: the tower's parameter and optimizer bytes per device (and the whole
state's) against the real sharded abstract train state (build_program on the suite's 8 fake CPU
devices), with train.freeze_text on and off; the step's FLOPs against XLA's cost analysis of the
compiled VL train step on one device; and the CLI's refusals of a context-parallel VL mesh."""

import math

import jax
import pytest

from tests.test_plan import _assert_user_error, _plan_cli
from tests.test_vision_training import BATCH, SEQ, _vl_config
from zaya_jax.parallel.mesh import make_mesh, parse_mesh_flag, resolve_mesh_shape
from zaya_jax.planner.step_plan import StepShape, _parameters, plan
from zaya_jax.planner.step_time import matmul_flops
from zaya_jax.train.optimizer import path_name, text_weight
from zaya_jax.train.program import abstract_batch, build_program, image_shape
from zaya_jax.train.settings import settings_from_config
from zaya_jax.parallel.rules import with_shardings


@pytest.fixture(scope="module")
def vl_config(tmp_path_factory):
    return _vl_config(tmp_path_factory.mktemp("plan_vl"), "unused")


def _shape(s, freeze_text: bool) -> StepShape:
    """The StepShape the planner CLI's step_shape reads from these settings (the data phase's batch)."""
    return StepShape(BATCH, SEQ, optimizer=s.optimizer.name,
                     shard_optimizer_over_data=s.mesh.shard_optimizer_over_data, platform="cpu",
                     loss_chunk=s.train.loss_chunk_size, objective=s.train.objective, vision=s.vision[0],
                     patch_capacity=s.train.patch_capacity, freeze_text=freeze_text)


def _bytes_per_device(tree, shardings, keep=lambda name: True) -> int:
    """Bytes one device holds of the per-parameter arrays of `tree` (ShapeDtypeStructs: leaves at a
    parameter's dict path, not counters or Muon's Newton-Schulz coefficients) whose path name `keep` holds."""
    sizes = jax.tree_util.tree_map_with_path(
        lambda path, leaf, sharding: math.prod(sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
        if isinstance(path[-1], jax.tree_util.DictKey) and keep(path_name(path)) else 0, tree, shardings)
    return sum(jax.tree.leaves(sizes))


@pytest.mark.parametrize("flag,zero1", [("data=8", False), ("data=2,fsdp=2,expert=2", False),
                                        ("data=4,tensor=2", True)])
@pytest.mark.parametrize("freeze_text", [True, False])
def test_vl_state_bytes_per_device_are_the_trainers(vl_config, flag, zero1, freeze_text):
    config = vl_config.copy_and_resolve_references()
    config.train.freeze_text = freeze_text
    config.mesh.update(data=1, fsdp=1, expert=1, tensor=1, shard_optimizer_over_data=zero1)
    config.mesh.update(parse_mesh_flag(flag))
    s = settings_from_config(config)
    program = build_program(s, make_mesh(parse_mesh_flag(flag)))
    state, shardings = program.abstract_state, program.shardings
    tower = lambda name: name.startswith("vision/") or "/vision/" in name  # noqa: E731
    real = {"params": _bytes_per_device(state.params, shardings.params),
            "optimizer_state": _bytes_per_device(state.opt_state, shardings.opt_state),
            "tower_params": _bytes_per_device(state.params, shardings.params, tower),
            "tower_optimizer_state": _bytes_per_device(state.opt_state, shardings.opt_state, tower),
            "trained_params": _bytes_per_device(state.params, shardings.params,
                                                lambda name: not (freeze_text and text_weight(name)))}
    ours = plan(s.model, resolve_mesh_shape(parse_mesh_flag(flag), 8), _shape(s, freeze_text))
    mem = ours["bytes_per_device"]
    assert real["tower_params"] > 0 and real["tower_optimizer_state"] > 0
    assert ours["vision"]["params"] == real["tower_params"]
    assert ours["vision"]["optimizer_state"] == real["tower_optimizer_state"]
    assert ours["vision"]["grads"] == real["tower_params"]
    assert mem["params"] == real["params"]
    assert mem["optimizer_state"] == real["optimizer_state"]
    assert mem["grads"] == real["trained_params"]
    assert (mem["grads"] < mem["params"]) == freeze_text
    assert mem["vision_activations_saved"] > 0


def _vl_step_flops(vl_config, freeze_text: bool) -> tuple[float, dict[str, float]]:
    """(XLA's cost analysis of the compiled VL train step, the planner's matmul FLOPs by op) on one
    device, one unrolled text layer, one loss chunk and a one-block tower (XLA's cost analysis counts a
    loop body once: tests/test_plan_flops.py), the widths 4x the fixture's (at its own, XLA's
    elementwise FLOPs, which the planner leaves to memory traffic, are 13% of the step)."""
    config = vl_config.copy_and_resolve_references()
    config.model.update(scan_layers=False, num_layers=1, hidden_size=128, head_dim=32, moe_intermediate_size=64,
                        router_hidden_size=32)
    config.vision.update(depth=1, fullatt_block_indexes=[0], hidden_size=64, intermediate_size=96, out_hidden_size=128)
    config.train.update(freeze_text=freeze_text, loss_chunk_size=SEQ, microbatches=1)
    config.mesh.update(data=1, fsdp=1, expert=1)
    s = settings_from_config(config)
    program = build_program(s, make_mesh(s.mesh.sizes, jax.devices()[:1]))
    compiled = program.train_step.lower(with_shardings(program.abstract_state, program.shardings),
                                        abstract_batch(BATCH, SEQ, image_shape(s)), s.model.rope_theta).compile()
    cost = compiled.cost_analysis()
    sizes = resolve_mesh_shape(s.mesh.sizes, 1)
    ours = matmul_flops(s.model, sizes, _shape(s, freeze_text), _parameters(s.model, sizes, s.vision[0]))
    return (cost[0] if isinstance(cost, list) else cost)["flops"], ours


def test_vl_step_flops_within_ten_percent_of_xla(vl_config):
    """The planner's matmul FLOPs of the VL step (the text model's on 2E experts with the experts'
    LoRA, the attention LoRA, and the tower's) against the compiled step's, with the text weights
    trained and frozen; and what freezing saves (the text weights' gradient matmuls and their Muon
    update), which alone is below the 10% of one step (the experts' gradients stay: 2E in one op)."""
    xla_trained, trained = _vl_step_flops(vl_config, False)
    xla_frozen, frozen = _vl_step_flops(vl_config, True)
    assert trained["vision_tower/blocks"] > 0 and trained["vision_tower/block_attention"] > 0
    assert sum(trained.values()) == pytest.approx(xla_trained, rel=0.10), (trained, xla_trained)   # 0.961
    assert sum(frozen.values()) == pytest.approx(xla_frozen, rel=0.10), (frozen, xla_frozen)       # 0.960
    saved = sum(trained.values()) - sum(frozen.values())
    assert saved == pytest.approx(xla_trained - xla_frozen, rel=0.10), (saved, xla_trained - xla_frozen)  # 0.965


@pytest.mark.parametrize("args,fragments", [
    (("--mesh", "data=4,context=2"),
     ("--mesh data=4,context=2", "vision-language config", "mesh.context = 1", "--mesh data=8")),
    # demo_vl's 16-row batch splits over at most 16 x tensor 2 devices without context
    (("--search", "--devices", "64", "--hardware", "h200"),
     ("--search --devices 64", "phase digits", "context > 1 (a vision-language run needs mesh.context = 1)")),
])
def test_plan_cli_refuses_context_parallel_for_a_vl_config(args, fragments):
    _assert_user_error(_plan_cli("--config", "configs/demo_vl.py", *args), *fragments)


def test_plan_cli_plans_the_zaya1_vl_8b_step():
    """configs/zaya1_vl_8b.py on data=64,fsdp=8: the tower's share of the state and its FLOPs are there."""
    import json
    done = _plan_cli("--config", "configs/zaya1_vl_8b.py", "--mesh", "data=64,fsdp=8", "--hardware", "h200", "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout)
    vision = summary["plan"]["vision"]
    assert vision["patches_per_row"] == 4096 and 0 < vision["params"] < summary["plan"]["bytes_per_device"]["params"]
    flops = summary["prediction"]["phases"][0]["prediction"]["flops_per_device"]
    assert flops["vision_tower/blocks"] > 0
