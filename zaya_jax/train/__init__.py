"""Training ZAYA1: `python -m zaya_jax.train --config configs/<name>.py --workdir DIR`.

  settings.py    the train / optimizer / balancing / checkpoint / eval / mesh / monitor / dpo sections
  data.py        the curriculum pipeline or synthetic batches, held-out batches
  state.py       TrainState (params, balancing biases, optimizer states, step, rng) and its specs
  loss.py        chunked next-token cross-entropy (no [B,S,V] logits)
  objectives.py  lm / sft (masked token mean) and dpo (against a frozen reference model)
  optimizer.py   Muon (matrices) + AdamW (the rest), or AdamW; schedules; weight-decay masks
  balancing.py   the router balancing controller (AdamW on load fraction - 1/E)
  step.py        the jitted train step (micro-batches, clipping, non-finite skip) and eval step
  checkpoint.py  the Checkpointer: async saves of whole train states, the step to resume from (the
                 format, its manifest and the model readers: zaya_jax.checkpoints)
  local_tier.py  the node-local checkpoint tier: each process's shards and its neighbour's, agreed restores
  metrics.py     router statistics, model FLOPs, MFU
  monitor.py     metrics.jsonl, TensorBoard, progress bar, expert-load heatmap
  faults.py      rollback (and its budget) after non-finite steps; SIGTERM / SIGINT agreed by all processes
  workdir_lock.py  one trainer per workdir
  loop.py        the Trainer
"""
