"""Forward+backward tokens/s of configs/bench_small.py: zaya_jax against HF transformers'
ZayaForCausalLM (PyTorch) on the same CPU, same weights, timed alternately. Prints JSON.

  python -m benchmarks.training.bench_small_fwd_bwd [--repeats 5] [--moe-backend auto]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from flax import nnx  # noqa: E402

from benchmarks.common import alternate_times  # noqa: E402
from benchmarks.training.hf_pair import bench_small, same_weights_pair  # noqa: E402
from zaya_jax.model.kernels import resolve_moe_backend  # noqa: E402


def next_token_loss(logits: jax.Array, ids: jax.Array) -> jax.Array:
    logits = logits[:, :-1]
    return jnp.mean(jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, ids[:, 1:, None], -1)[..., 0])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--moe-backend", default="auto")
    args = parser.parse_args()
    config, cfg = bench_small(args.moe_backend)
    batch, seq = config.train.global_batch_size, config.train.seq_len
    hf, model = same_weights_pair(cfg, os.cpu_count())
    ids_np = np.random.default_rng(0).integers(3, cfg.vocab_size, (batch, seq))
    ids = jnp.asarray(ids_np)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    step = jax.jit(jax.value_and_grad(lambda p, x: next_token_loss(nnx.merge(graphdef, p, rest)(x), x)))
    ids_t = torch.as_tensor(ids_np)

    def torch_step():
        hf.zero_grad(set_to_none=True)
        hf(ids_t, labels=ids_t).loss.backward()

    def jax_step():
        jax.block_until_ready(step(params, ids))

    jax_times, torch_times = alternate_times(jax_step, torch_step, args.repeats)
    jax_t, torch_t = statistics.median(jax_times), statistics.median(torch_times)
    tokens = batch * seq
    print(json.dumps({
        "config": "bench_small", "platform": jax.default_backend(), "tokens_per_step": tokens,
        "moe_backend": resolve_moe_backend(args.moe_backend),
        "zaya_jax_s_per_step": round(jax_t, 4), "hf_torch_s_per_step": round(torch_t, 4),
        "zaya_jax_tokens_per_s": round(tokens / jax_t, 1), "hf_torch_tokens_per_s": round(tokens / torch_t, 1),
        "speedup_vs_hf": round(torch_t / jax_t, 3),
        # best of the alternated runs: what each side does when the machine leaves it alone
        "zaya_jax_best_s": round(min(jax_times), 4), "hf_torch_best_s": round(min(torch_times), 4),
        "speedup_vs_hf_best": round(min(torch_times) / min(jax_times), 3), "torch_threads": torch.get_num_threads(),
    }, indent=2))


if __name__ == "__main__":
    main()
