"""The planner's per-device bytes against XLA's compiled memory analysis, on meshes that
compile here (8 fake CPU devices). Prints JSON.

  python -m benchmarks.planner.planner_vs_xla [--config configs/bench_small.py]

XLA's numbers are for a jitted AdamW train step (loss, gradients, update): arguments hold the
parameters, optimizer state and batch; temporaries hold gradients and activations.
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

from zaya_jax.config_files import load_config_file, model_config  # noqa: E402
from zaya_jax.model.build import abstract_model  # noqa: E402
from zaya_jax.parallel.mesh import make_mesh, parse_mesh_flag, resolve_mesh_shape  # noqa: E402
from zaya_jax.parallel.rules import batch_spec, state_shardings  # noqa: E402
from zaya_jax.planner.step_plan import StepShape, plan  # noqa: E402


def xla_memory(cfg, mesh, batch: int, seq: int) -> dict:
    model = abstract_model(cfg)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tx = optax.adamw(1e-3)
    with jax.set_mesh(mesh):
        p_shard = state_shardings(params, mesh)
        opt_abstract = jax.eval_shape(tx.init, params)
        opt_shard = optax.tree_map_params(tx, lambda _, s: s, opt_abstract, p_shard,
                                          transform_non_params=lambda _: NamedSharding(mesh, jax.P()))
        r_shard = state_shardings(rest, mesh)

        def step(params, opt_state, rest, ids):
            def loss(p):
                logits = nnx.merge(graphdef, p, rest)(ids)[:, :-1]
                return jnp.mean(jax.nn.logsumexp(logits, -1)
                                - jnp.take_along_axis(logits, ids[:, 1:, None], -1)[..., 0])
            value, grads = jax.value_and_grad(loss)(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, value

        ids = jax.ShapeDtypeStruct((batch, seq), jnp.int32, sharding=NamedSharding(mesh, batch_spec(mesh)))
        with_sharding = lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)  # noqa: E731
        compiled = jax.jit(step, donate_argnums=(0, 1), out_shardings=(p_shard, opt_shard, None)).lower(
            jax.tree.map(with_sharding, params, p_shard), jax.tree.map(with_sharding, opt_abstract, opt_shard),
            jax.tree.map(with_sharding, rest, r_shard), ids).compile()
    m = compiled.memory_analysis()
    return {"arguments": m.argument_size_in_bytes, "temporaries": m.temp_size_in_bytes,
            "outputs": m.output_size_in_bytes}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="configs/bench_small.py")
    parser.add_argument("--meshes", default="data=8;fsdp=8;data=2,fsdp=2,expert=2;data=4,tensor=2")
    args = parser.parse_args()
    config = load_config_file(args.config)
    cfg = model_config(config).replace(moe_backend="tiles")
    batch, seq = config.train.global_batch_size, config.train.seq_len
    rows = []
    for flag in args.meshes.split(";"):
        mesh = make_mesh(parse_mesh_flag(flag))
        xla = xla_memory(cfg, mesh, batch, seq)
        ours = plan(cfg, resolve_mesh_shape(parse_mesh_flag(flag), 8), StepShape(batch, seq, platform=jax.default_backend()))["bytes_per_device"]
        state = ours["params"] + ours["optimizer_state"]
        temps = ours["total"] - state
        rows.append({"mesh": flag, "xla": xla,
                     "planner_params_plus_optimizer": state, "planner_grads_plus_activations": temps,
                     "ratio_state_vs_xla_arguments": round(state / xla["arguments"], 3),
                     "ratio_temporaries_vs_xla": round(temps / xla["temporaries"], 3),
                     "ratio_total_vs_xla": round((state + temps) / (xla["arguments"] + xla["temporaries"]), 3)})
    print(json.dumps({"config": args.config, "remat": cfg.remat, "dtype": cfg.dtype, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
