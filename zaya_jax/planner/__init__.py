"""The planner: what a training step costs on a mesh and hardware, from shapes alone.

  step_plan    per-device memory and collective bytes of one step (StepShape, plan)
  step_flops   matmul FLOPs one step executes per device
  tower_plan   a vision-language step's tower: its activations and FLOPs (its parameters are step_plan's)
  step_time    predicted step time from FLOPs, HBM bytes and collectives on a hardware profile
  phase_plan   a curriculum phase's step shape, mesh and prediction
  mesh_search  every feasible mesh of N devices, ranked per phase and for the whole run
  serve_plan   serving on one GPU: weight and per-request decode-state bytes, slots, decode tokens/s
  goodput      the fraction of wall time that trains under node failures, with and without the local checkpoint tier
  __main__     the CLI: python -m zaya_jax.planner --config configs/zaya1_base.py [--mesh ...|--search]
It sits above zaya_jax.train (it reads the trainer's settings, data phases, loss, objectives and
optimizer) and zaya_jax.parallel (the mesh, the sharding rules); nothing below imports it.
"""
