"""Distributed self-check: the same deterministic batches give the same losses on any layout.

  python -m zaya_jax.parallel.check --config configs/tiny.py --mesh data=8 --batches 3
  launch/local.sh 2 --devices-per-process 4 python -m zaya_jax.parallel.check --config configs/tiny.py --mesh data=8

Every process builds the same model (seeded init), takes its rows of each global batch,
assembles the global batch, and process 0 prints one JSON line with the losses.
"""

from __future__ import annotations

import json

from absl import app, flags
from ml_collections import config_flags

from zaya_jax import cli
from zaya_jax.config_files import model_config
from zaya_jax.model.build import create_model
from zaya_jax.parallel import distributed
from zaya_jax.parallel.mesh import MESH_FLAG, make_mesh, parse_mesh_flag
from zaya_jax.parallel.rules import state_shardings

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a config file (configs/*.py).")
_MESH = flags.DEFINE_string("mesh", "data=-1", "Mesh axes, e.g. data=2,fsdp=4.")
_BATCHES = flags.DEFINE_integer("batches", 3, "Number of batches to score.")


def losses(config, mesh_flag: str, num_batches: int) -> list[float]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx


    cfg = model_config(config)
    mesh = make_mesh(parse_mesh_flag(mesh_flag), flag=MESH_FLAG)
    batch, seq = config.train.global_batch_size, config.train.seq_len
    rows = distributed.local_batch_rows(batch)
    model = create_model(cfg, seed=config.train.seed)
    graphdef, params = nnx.split(model)

    def loss(params, ids):
        logits = nnx.merge(graphdef, params)(ids)[:, :-1]
        return jnp.mean(jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, ids[:, 1:, None], -1)[..., 0])

    out = []
    with jax.set_mesh(mesh):
        params = jax.device_put(params, state_shardings(params, mesh))
        step = jax.jit(loss)
        for i in range(num_batches):
            ids = np.random.default_rng([config.train.seed, i]).integers(3, cfg.vocab_size, (batch, seq))
            out.append(float(step(params, distributed.global_batch({"ids": ids[rows]}, mesh)["ids"])))
    return out


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if _CONFIG.value is None:
        raise app.UsageError("--config is required")
    how = distributed.initialize()
    import jax
    result = {"how": how, **distributed.topology(), "mesh": _MESH.value,
              "losses": losses(_CONFIG.value, _MESH.value, _BATCHES.value)}
    if jax.process_index() == 0:
        print(json.dumps(result))


if __name__ == "__main__":
    cli.run(main)
