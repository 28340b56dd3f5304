"""ZeRO-1 over the whole data-parallel group: the optimizer state is sliced over data x context
(zaya_jax.parallel.rules.zero1_axes, as Megatron-Core's distributed optimizer shards over DP x
CP), so XLA's partitioner sums each gradient in one collective over every replica.

The evidence is the compiled step of the launch config's model (benchmarks/planner/compiled_collectives.py:
configs/zaya1_base.py at its real widths, 2 layers, on its own mesh shape data=4 x context=2):
the bytes of the gradient all-reduces by the size of their replica groups. With the optimizer
state sliced over data alone, the control, the partitioner instead sums most gradients over data
(4 devices) and again over context (2): on 1,024 MI300X that is twice the bytes through each NIC
(planner.step_time.link_of: 4 data members in a node instead of 8).
The correctness of the sliced state is test_proof_sharded_training's (data=2,context=2,tensor=2
with ZeRO-1 equal to one device) and test_gradient_reduce's (data=4,context=2 summed by hand).
"""

import pytest
from jax.sharding import PartitionSpec as P

from benchmarks.planner.compiled_collectives import compiled_step, gradient_bytes_by_group_size, launch_config
from zaya_jax.parallel import rules
from zaya_jax.planner.step_time import link_of


def test_gradients_are_summed_once_over_data_and_context():
    joint = gradient_bytes_by_group_size(compiled_step(launch_config()))  # the shipped rules.ZERO1_AXES
    # 2.96 of 3.01 GB over all 8 (results/compiled_collectives_cpu.json); the rest moves Muon's stacks
    assert joint.get(8, 0) >= 0.95 * sum(joint.values()) > 1e9, joint
    data_alone = gradient_bytes_by_group_size(compiled_step(launch_config(), ("data",)))
    assert data_alone.get(8, 0) < 0.3 * sum(data_alone.values()), data_alone  # 0.81 of 4.08 GB
    assert data_alone.get(4, 0) > 0.5 * sum(data_alone.values()), data_alone


def test_optimizer_state_slices_over_data_then_context():
    mesh = {"data": 4, "fsdp": 1, "expert": 1, "tensor": 1, "context": 2}
    assert rules.with_zero1_axes(P(None, "tensor"), (64, 32), mesh) == P(("data", "context"), "tensor")
    assert rules.with_zero1_axes(P(None), (12,), mesh) == P(None)  # 8 does not divide 12: left whole
    assert rules.with_zero1_axes(P(None), (16,), {**mesh, "context": 1}) == P("data")
    assert rules.with_zero1_axes(P("data"), (16,), mesh) == P("data")


@pytest.mark.parametrize("mesh,expected", [
    ({"data": 512, "context": 2}, ("inter_node", 8)),             # the launch: every GPU of a node, 8 NICs
    ({"data": 128, "fsdp": 4, "context": 2}, ("inter_node", 2)),  # fsdp fills the node between them
    ({"data": 4, "context": 2}, ("intra_node", 8)),
])
def test_the_planner_sends_the_group_through_every_nic_of_a_node(mesh, expected):
    full = {"data": 1, "fsdp": 1, "expert": 1, "tensor": 1, "context": 1, **mesh}
    assert link_of("data+context", full, 8) == expected
