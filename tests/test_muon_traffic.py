"""What Muon's Newton-Schulz sends, with and without optimizer.muon_distributed, in the compiled step
of the launch config's model (configs/zaya1_base.py at its real widths, 2 layers) on its own mesh
shape (data=4 x context=2, ZeRO-1 over both), against the planner's collective model
(planner.step_plan.collectives).

The model keeps 6 experts so that, as at 1,024 GPUs (40 layers x 16 experts over 1,024 ranks),
ZeRO-1 slices a matrix axis of every expert weight, not a stack axis. Without the option the
partitioner keeps that slice through Newton-Schulz and gathers the whole other operand at each of
its 3 matmuls per iteration (every rank receives 15 x the stack per weight per step); with it each
rank orthogonalises its own ceil(B / 8) whole matrices after an all-to-all, and the gathers are
gone. XLA:CPU's partitioner is the one GPUs run; the bytes are the collectives' per-device results.
"""

import math
import re

import jax
import pytest

from zaya_jax.config_files import load_config_file, model_config
from zaya_jax.parallel.mesh import make_mesh
from zaya_jax.planner.step_plan import StepShape, collectives, plan
from zaya_jax.train.program import abstract_batch, build_program
from zaya_jax.train.settings import settings_from_config
from zaya_jax.train.state import with_shardings

_COLLECTIVE = re.compile(r"= (.*?) (all-gather|all-to-all|collective-permute)(?:-start)?\(.*?op_name=\"([^\"]*)\"")


def _config(distributed: bool):
    config = load_config_file("configs/zaya1_base.py")
    config.model.update(num_layers=2, num_experts=6)
    config.train.update(global_batch_size=4, seq_len=320, steps=100)
    config.optimizer.update(warmup_steps=10, muon_distributed=distributed)
    return config


def optimizer_traffic(distributed: bool) -> tuple[dict[str, float], set[tuple[int, int, int]]]:
    """({collective: bytes per device} inside the optimizer's update, {(batch, rows, cols) of the
    compiled [2048 x 2048]-wide Newton-Schulz dots}) of the compiled step."""
    s = settings_from_config(_config(distributed))
    mesh = make_mesh(s.mesh.sizes)
    assert dict(mesh.shape) == {"data": 4, "fsdp": 1, "expert": 1, "tensor": 1, "context": 2}
    program = build_program(s, mesh)
    with jax.set_mesh(mesh):
        text = program.train_step.lower(with_shardings(program.abstract_state, program.shardings),
                                        abstract_batch(4, 320), s.model.rope_theta).compile().as_text()
    sent: dict[str, float] = {}
    for results, kind, op_name in _COLLECTIVE.findall(text):
        if "/optimizer/" in op_name:
            sent[kind] = sent.get(kind, 0.0) + sum(4 * math.prod(int(n) for n in dims.split(","))
                                                   for dims in re.findall(r"f32\[([\d,]+)\]", results))
    dots = {tuple(map(int, d)) for d in re.findall(r"= f32\[(\d+),(\d+),(\d+)\]\{[\d,]+\} dot\(", text)}
    return sent, {d for d in dots if 2048 in d[1:]}


def planned(distributed: bool) -> dict[str, float]:
    config = _config(distributed)
    cfg, mesh = model_config(config), {"data": 4, "fsdp": 1, "expert": 1, "tensor": 1, "context": 2}
    shape = StepShape(4, 320, optimizer="muon", shard_optimizer_over_data=True, distributed_muon=distributed)
    rows = collectives(cfg, mesh, shape, plan(cfg, mesh, shape)["bytes_per_device"])
    return {c.kind: c.bytes / (7 / 8) for c in rows if "Muon" in c.what}  # ring factor off: what each rank holds


def test_newton_schulz_gathers_every_operand_unless_distributed():
    off, off_dots = optimizer_traffic(False)
    on, on_dots = optimizer_traffic(True)
    # off: each rank's share of rows of the whole 12-matrix expert stack, the rest gathered
    assert (12, 256, 2048) in off_dots, off_dots
    # 9.29 GB measured, 9.77 planned (the planner also gathers the small attention matrices 15 times)
    assert off["all-gather"] == pytest.approx(planned(False)["all_gather"], rel=0.1), (off, planned(False))
    # on: 16 padded matrices over 8 ranks, two whole 2048 x 2048 matrices each; an all-to-all there
    # and back instead of the gathers
    assert {d[0] for d in on_dots if d[1:] == (2048, 2048)} == {2}, on_dots
    assert sum(on.values()) < 0.15 * sum(off.values()), (on, off)
    # 0.497 GB each; the partitioner adds 0.2 GB of permutes and 0.2 GB of gathers the planner leaves out
    assert on["all-to-all"] == pytest.approx(planned(True)["all_to_all"], rel=0.05), (on, planned(True))
    assert sum(on.values()) < 2 * planned(True)["all_to_all"], on
