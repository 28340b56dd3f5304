"""How long a checkpoint save blocks the training loop: asynchronous against synchronous. Prints JSON.

  python -m benchmarks.checkpoints.checkpoint_save [--config configs/bench_small.py] [--repeats 3] [--optimizer muon]

The state is the trainer's own (parameters, balancing biases, optimizer and controller states,
counters) for the config's model, placed on its mesh; each save goes through
zaya_jax.train.checkpoint.Checkpointer exactly as the loop calls it. `blocking_s` is the time
save() takes to return (what the loop waits for); `total_s` also waits for the write to finish.
The first save of a process is reported apart (it sets up Orbax's writers).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from benchmarks.common import REPO  # noqa: E402
from zaya_jax.config_files import load_config_file  # noqa: E402
from zaya_jax.model.zaya import ZayaLM  # noqa: E402
from zaya_jax.parallel.mesh import make_mesh  # noqa: E402
from zaya_jax.train import balancing  # noqa: E402
from zaya_jax.train.checkpoint import Checkpointer  # noqa: E402
from zaya_jax.train.data import SyntheticIterator, synthetic_phase  # noqa: E402
from zaya_jax.train.optimizer import make_optimizer  # noqa: E402
from zaya_jax.train.settings import CheckpointSettings, settings_from_config  # noqa: E402
from zaya_jax.checkpoints.model_parts import ModelParts  # noqa: E402
from zaya_jax.parallel.rules import to_shardings  # noqa: E402
from zaya_jax.train.state import initial_state, state_specs  # noqa: E402


def build_state(settings, optimizer: str):
    opt = settings.optimizer.__class__(**{**vars(settings.optimizer), "name": optimizer})
    tx, controller = make_optimizer(opt, settings.train.steps), balancing.make_controller(settings.balancing)
    mesh = make_mesh(settings.mesh.sizes)

    def init():
        params, biases = ModelParts.arrays(ZayaLM(settings.model, rngs=nnx.Rngs(0)))
        return initial_state(params, biases, tx, controller, 0)

    abstract = jax.eval_shape(init)
    parts = ModelParts(nnx.eval_shape(lambda: ZayaLM(settings.model, rngs=nnx.Rngs(0))))
    specs = state_specs(abstract, parts.param_specs(mesh), parts.biases_spec(mesh), mesh,
                        settings.mesh.shard_optimizer_over_data)
    with jax.set_mesh(mesh):
        return jax.jit(init, out_shardings=to_shardings(specs, mesh))()


def time_saves(state, data, config_json, async_save: bool, repeats: int) -> dict:
    directory = tempfile.mkdtemp(prefix="ckpt_bench_")
    checkpointer = Checkpointer(directory, CheckpointSettings(every_steps=0, max_to_keep=2, async_save=async_save))
    blocking, total = [], []
    try:
        for i in range(repeats + 1):
            state = state.replace(step=state.step + 1)
            jax.block_until_ready(state)
            start = time.perf_counter()
            checkpointer.save(state, data, config_json)
            blocking.append(time.perf_counter() - start)
            checkpointer.wait()
            total.append(time.perf_counter() - start)
    finally:
        checkpointer.close()
        shutil.rmtree(directory, ignore_errors=True)
    return {"first_blocking_s": round(blocking[0], 4), "first_total_s": round(total[0], 4),
            "blocking_s": round(float(np.median(blocking[1:])), 4), "total_s": round(float(np.median(total[1:])), 4)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default=os.path.join(REPO, "configs", "bench_small.py"))
    parser.add_argument("--optimizer", default="muon", choices=["muon", "adamw"])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    load_start = os.getloadavg()[0]
    config = load_config_file(args.config)
    settings = settings_from_config(config)
    state = build_state(settings, args.optimizer)
    data = SyntheticIterator(synthetic_phase(settings), settings.model.vocab_size, 0)
    config_json = json.loads(config.to_json_best_effort())
    nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
    asynchronous = time_saves(state, data, config_json, True, args.repeats)
    synchronous = time_saves(state, data, config_json, False, args.repeats)
    print(json.dumps({
        "config": os.path.basename(args.config), "optimizer": args.optimizer, "platform": jax.default_backend(),
        "devices": jax.device_count(), "state_mb": round(nbytes / 2**20, 1),
        "async": asynchronous, "sync": synchronous,
        "loop_blocked_async_vs_sync": round(asynchronous["blocking_s"] / synchronous["blocking_s"], 3),
        "load_average_1min_start_end": [round(load_start, 2), round(os.getloadavg()[0], 2)],
    }, indent=2))


if __name__ == "__main__":
    main()
