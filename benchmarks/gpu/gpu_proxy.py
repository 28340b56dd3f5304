"""ZAYA1-base-width proxy training steps through the Trainer itself, on the GPUs of this process.

    run(layers, optimizer) -> {"layers", "optimizer", "devices", "step_s", "tokens_per_sec", "mfu",
                               "model_flops_per_step", "loss"}
    derived(runs)          -> per-layer MFU by differencing two depths (the LM head, embedding and
                              optimizer drop out), the Newton-Schulz time (Muon minus AdamW at one
                              depth) and each run's whole-step MFU

configs/zaya1_base.py at its real widths, vocabulary and heads (D 2048, 16 experts, 8 query / 2 KV
heads of 128, V 262,272), bf16, its remat policy, with `layers` layers; synthetic data, seq 4096,
2 sequences per device; the mesh is data over every local device (context, tensor, fsdp and
expert 1), so it resolves on 1, 2 or 8 GPUs. STEPS steps, logged every LOG_EVERY: the last window
excludes the compile. MFU is the trainer's (model FLOPs over the device profile's bf16 peak).
"""

from __future__ import annotations

import os
import tempfile

from benchmarks.common import REPO  # noqa: E402
SEQ_LEN, SEQUENCES_PER_DEVICE, STEPS, LOG_EVERY = 4096, 2, 8, 4
DEPTHS = (2, 4)
RUNS = (("adamw", 2), ("adamw", 4), ("muon", 4))  # (optimizer, layers): the self-test's proxy sections


def config_for(layers: int, optimizer: str, devices: int):
    from zaya_jax.config_files import load_config_file
    config = load_config_file(os.path.join(REPO, "configs/zaya1_base.py"))
    config.model.num_layers = layers
    config.optimizer.name = optimizer
    config.optimizer.warmup_steps = 2
    config.train.update(dict(data="synthetic", seq_len=SEQ_LEN, global_batch_size=SEQUENCES_PER_DEVICE * devices,
                             steps=STEPS, log_every_steps=LOG_EVERY))
    config.eval.every_steps = 0
    config.checkpoint.every_steps = 0
    config.mesh.update(dict(data=-1, fsdp=1, expert=1, tensor=1, context=1))
    config.monitor.update(dict(progress_bar=False, tensorboard=False, heatmap_every_steps=0))
    return config


def run(layers: int, optimizer: str) -> dict:
    import jax

    from zaya_jax.config_files import model_config
    from zaya_jax.train.loop import Trainer
    from zaya_jax.train.metrics import flops_per_token
    devices = jax.device_count()
    config = config_for(layers, optimizer, devices)
    records = []
    with tempfile.TemporaryDirectory() as workdir:
        trainer = Trainer(config, workdir, on_log=records.append)
        try:
            trainer.run()
        finally:
            trainer.close()
    last = [r for r in records if r["kind"] == "train"][-1]
    tokens = SEQUENCES_PER_DEVICE * devices * SEQ_LEN
    return {"layers": layers, "optimizer": optimizer, "devices": devices, "seq_len": SEQ_LEN,
            "global_batch_size": SEQUENCES_PER_DEVICE * devices, "step_s": tokens / last["tokens_per_sec"],
            "tokens_per_sec": last["tokens_per_sec"], "mfu": last["mfu"], "loss": last["loss"],
            "model_flops_per_step": flops_per_token(model_config(config), SEQ_LEN) * tokens}


def derived(runs: dict[str, dict]) -> dict:
    """From the RUNS' results ({"adamw_2": run(2, "adamw"), ...}; a failed one is {"error"}): per-layer
    step time, FLOPs and MFU from the two AdamW depths, and Muon's extra time at the deeper one."""
    out = {}
    short, long, muon = (runs.get(f"{o}_{n}", {}) for o, n in RUNS)
    if "step_s" in short and "step_s" in long:
        layers = long["layers"] - short["layers"]
        seconds = (long["step_s"] - short["step_s"]) / layers
        flops = (long["model_flops_per_step"] - short["model_flops_per_step"]) / layers
        peak = long["model_flops_per_step"] / (long["step_s"] * long["mfu"]) if long["mfu"] else None
        out["per_layer"] = {"seconds": seconds, "model_flops": flops,
                            "mfu": flops / (seconds * peak) if peak and seconds > 0 else None}
    if "step_s" in long and "step_s" in muon:
        out["newton_schulz_s_per_step"] = muon["step_s"] - long["step_s"]
    out["whole_step_mfu"] = {name: r["mfu"] for name, r in runs.items() if "mfu" in r}
    return out
