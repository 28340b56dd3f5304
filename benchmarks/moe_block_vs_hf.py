"""One MoE block (router + 16 experts) forward+backward at bench_small's shape: zaya_jax against
HF transformers' ZayaSparseMoeBlock with the same weights and input, timed alternately. Prints
JSON, with the largest output difference (same function, same routing) and the expert
implementation HF used (transformers dispatches the experts to torch's grouped matmul).

  python benchmarks/moe_block_vs_hf.py [--repeats 9] [--layer 1] [--moe-backend auto]

This is the part of the step where the two frameworks differ most: torch multiplies each
expert's exact rows (`torch._grouped_mm` on CPU); XLA has no grouped matmul on CPU
(`ragged_dot` computes every expert), so the `tiles` backend pads each expert's rows to
windows of `moe_tile_size` and loops.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from flax import nnx  # noqa: E402

from benchmarks.common import alternate_times  # noqa: E402
from benchmarks.hf_pair import same_weights_pair  # noqa: E402
from zaya_jax.config_files import load_config_file, model_config  # noqa: E402
from zaya_jax.model.kernels import moe_dispatch_fn, resolve_moe_backend  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--layer", type=int, default=1, help="which layer's weights (0 has no EDA input)")
    parser.add_argument("--moe-backend", default="auto")
    args = parser.parse_args()
    config = load_config_file(os.path.join(os.path.dirname(__file__), "..", "configs", "bench_small.py"))
    cfg = model_config(config).replace(moe_backend=args.moe_backend)
    batch, seq = config.train.global_batch_size, config.train.seq_len
    hf, model = same_weights_pair(cfg, os.cpu_count())
    hf_block = hf.model.layers[args.layer].mlp

    rng = np.random.default_rng(0)
    x_np = rng.standard_normal((batch, seq, cfg.hidden_size)).astype(np.float32)
    prev_np = rng.standard_normal((batch, seq, cfg.router_hidden_size)).astype(np.float32)
    x_t = torch.as_tensor(x_np).requires_grad_(True)
    prev_t = torch.as_tensor(prev_np)

    layer_def, layer_states = nnx.split(model.layers)
    layer = nnx.merge(layer_def, jax.tree.map(lambda a: a[args.layer], layer_states))
    moe_def, moe_state = nnx.split(layer.moe)
    dispatch = moe_dispatch_fn(cfg)
    mask = jnp.ones((batch, seq), bool)
    x, prev = jnp.asarray(x_np), jnp.asarray(prev_np)

    def block(p, x):
        return nnx.merge(moe_def, p)(x, prev, mask, dispatch)[0]

    step = jax.jit(jax.grad(lambda p, x: jnp.sum(block(p, x) ** 2), argnums=(0, 1)))

    def jax_step():
        jax.block_until_ready(step(moe_state, x))

    def torch_step():
        hf_block.zero_grad(set_to_none=True)
        x_t.grad = None
        hf_block(x_t, prev_t)[0].square().sum().backward()

    with torch.no_grad():
        diff = float(np.max(np.abs(np.asarray(jax.jit(block)(moe_state, x)) - hf_block(x_t, prev_t)[0].numpy())))
    jax_times, torch_times = alternate_times(jax_step, torch_step, args.repeats)
    jax_t, torch_t = statistics.median(jax_times), statistics.median(torch_times)
    print(json.dumps({
        "config": "bench_small", "platform": jax.default_backend(), "layer": args.layer,
        "tokens": batch * seq, "moe_backend": resolve_moe_backend(args.moe_backend),
        "hf_experts_implementation": hf.config._experts_implementation,
        "max_abs_output_diff": diff,
        "zaya_jax_s": round(jax_t, 4), "hf_torch_s": round(torch_t, 4), "speedup_vs_hf": round(torch_t / jax_t, 3),
        "zaya_jax_best_s": round(min(jax_times), 4), "hf_torch_best_s": round(min(torch_times), 4),
        "speedup_vs_hf_best": round(min(torch_times) / min(jax_times), 3),
        "torch_threads": torch.get_num_threads(),
    }, indent=2))


if __name__ == "__main__":
    main()
