"""What Muon's Newton-Schulz sends, with and without optimizer.muon_distributed, in the compiled step
of the launch config's model (benchmarks/planner/compiled_collectives.py: configs/zaya1_base.py at its
real widths, 2 layers, on its own mesh shape data=4 x context=2, ZeRO-1 over both), against the
planner's collective model (planner.step_plan.collectives).

The model keeps 6 experts so that, as at 1,024 GPUs (40 layers x 16 experts over 1,024 ranks),
ZeRO-1 slices a matrix axis of every expert weight, not a stack axis. Without the option the
partitioner keeps that slice through Newton-Schulz and gathers the whole other operand at each of
its 3 matmuls per iteration (every rank receives 15 x the stack per weight per step); with it each
rank orthogonalises its own ceil(B / 8) whole matrices after an all-to-all, and the gathers are
gone.
"""

import pytest

from benchmarks.planner.compiled_collectives import compiled_step, launch_config, optimizer_moves, planned_muon, stacked_dots


def test_newton_schulz_gathers_every_operand_unless_distributed():
    off_config, on_config = launch_config(6, muon_distributed=False), launch_config(6, muon_distributed=True)
    off_hlo, on_hlo = compiled_step(off_config), compiled_step(on_config)
    off, on = optimizer_moves(off_hlo), optimizer_moves(on_hlo)
    # off: each rank's share of rows of the whole 12-matrix expert stack, the rest gathered;
    # 9.29 GB measured, 9.77 planned (the planner also gathers the small attention matrices 15 times)
    assert [12, 256, 2048] in stacked_dots(off_hlo), stacked_dots(off_hlo)
    assert off["all-gather"] == pytest.approx(planned_muon(off_config)["all_gather"], rel=0.1), off
    # on: 16 padded matrices over 8 ranks, two whole 2048 x 2048 matrices each; an all-to-all there
    # and back instead of the gathers
    assert {d[0] for d in stacked_dots(on_hlo) if d[1:] == [2048, 2048]} == {2}, stacked_dots(on_hlo)
    assert sum(on.values()) < 0.15 * sum(off.values()), (on, off)
    # 0.497 GB each; the partitioner adds 0.2 GB of permutes and 0.2 GB of gathers the planner leaves out
    planned = planned_muon(on_config)["all_to_all"]
    assert on["all-to-all"] == pytest.approx(planned, rel=0.05), (on, planned)
    assert sum(on.values()) < 2 * planned, on
