"""One decoder layer's two blocks, forward+backward at bench_small's shape, against HF
transformers with the same weights and input, timed alternately: the CCA attention block
(ZayaAttention: projections, convolutions, norms, RoPE, causal attention, output projection) and
the MoE block (ZayaSparseMoeBlock: router + 16 experts). Prints JSON with, per block, the
largest output difference (same function, same routing) and the times; and the expert
implementation HF used (transformers dispatches the experts to torch's grouped matmul).

  python -m benchmarks.training.blocks_vs_hf [--repeats 9] [--layer 1] [--moe-backend auto]

torch multiplies each expert's exact rows (`torch._grouped_mm` on CPU); XLA has no grouped
matmul on CPU (`ragged_dot` computes every expert), so the `tiles` backend pads each expert's
rows to windows of `moe_tile_size` and loops.
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
from transformers.masking_utils import create_causal_mask, create_recurrent_attention_mask  # noqa: E402

from benchmarks.common import alternate_times  # noqa: E402
from benchmarks.training.hf_pair import bench_small, same_weights_pair  # noqa: E402
from zaya_jax.model.kernels import attention_fn, moe_dispatch_fn, resolve_moe_backend  # noqa: E402
from zaya_jax.model.rope import rope_cos_sin  # noqa: E402


def compare(ours, params, theirs, module: torch.nn.Module, x_np: np.ndarray, repeats: int) -> dict:
    """ours(params, x [B,S,D]) -> [B,S,D] (jax); theirs(x) -> [B,S,D] (torch, parameters in
    `module`). Forward+backward of sum(out**2) with respect to the parameters and x."""
    x, x_t = jnp.asarray(x_np), torch.as_tensor(x_np).requires_grad_(True)
    step = jax.jit(jax.grad(lambda p, x: jnp.sum(ours(p, x) ** 2), argnums=(0, 1)))

    def jax_step():
        jax.block_until_ready(step(params, x))

    def torch_step():
        x_t.grad = None
        module.zero_grad(set_to_none=True)
        theirs(x_t).square().sum().backward()

    with torch.no_grad():
        diff = float(np.max(np.abs(np.asarray(jax.jit(ours)(params, x)) - theirs(x_t).numpy())))
    jax_times, torch_times = alternate_times(jax_step, torch_step, repeats)
    jax_t, torch_t = statistics.median(jax_times), statistics.median(torch_times)
    return {"max_abs_output_diff": diff,
            "zaya_jax_s": round(jax_t, 4), "hf_torch_s": round(torch_t, 4), "speedup_vs_hf": round(torch_t / jax_t, 3),
            "zaya_jax_best_s": round(min(jax_times), 4), "hf_torch_best_s": round(min(torch_times), 4),
            "speedup_vs_hf_best": round(min(torch_times) / min(jax_times), 3)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--layer", type=int, default=1, help="which layer's weights (0 has no EDA input)")
    parser.add_argument("--moe-backend", default="auto")
    args = parser.parse_args()
    config, cfg = bench_small(args.moe_backend)
    batch, seq = config.train.global_batch_size, config.train.seq_len
    hf, model = same_weights_pair(cfg, os.cpu_count())
    hf_layer = hf.model.layers[args.layer]
    layer_def, layer_states = nnx.split(model.layers)
    layer = nnx.merge(layer_def, jax.tree.map(lambda a: a[args.layer], layer_states))

    rng = np.random.default_rng(0)
    x_np = rng.standard_normal((batch, seq, cfg.hidden_size)).astype(np.float32)
    prev_np = rng.standard_normal((batch, seq, cfg.router_hidden_size)).astype(np.float32)

    # attention: ours takes (x, cos, sin, segment_ids, attention); HF its masks and RoPE tables
    cos, sin = rope_cos_sin(jnp.broadcast_to(jnp.arange(seq), (batch, seq)), cfg.rotary_dim, cfg.rope_theta)
    segment_ids, attention = jnp.ones((batch, seq), jnp.int32), attention_fn(cfg)
    attn_def, attn_params = nnx.split(layer.attention)
    position_ids = torch.arange(seq)[None]
    mask_kwargs = dict(config=hf.config, inputs_embeds=torch.as_tensor(x_np), attention_mask=None, cache=None,
                       position_ids=position_ids)
    hf_masks = {"causal": create_causal_mask(**mask_kwargs), "conv": create_recurrent_attention_mask(**mask_kwargs)}
    hf_rope = hf.model.rotary_emb(torch.as_tensor(x_np), position_ids, hf.config.layer_types[args.layer])
    attention_row = compare(
        lambda p, x: nnx.merge(attn_def, p)(x, cos, sin, segment_ids, attention), attn_params,
        lambda x: hf_layer.self_attn(hidden_states=x, attention_mask=hf_masks, position_embeddings=hf_rope)[0],
        hf_layer.self_attn, x_np, args.repeats)

    # MoE: router (given the previous block's router state) + experts
    prev, prev_t = jnp.asarray(prev_np), torch.as_tensor(prev_np)
    token_mask, dispatch = jnp.ones((batch, seq), bool), moe_dispatch_fn(cfg)
    moe_def, moe_params = nnx.split(layer.moe)
    moe_row = compare(lambda p, x: nnx.merge(moe_def, p)(x, prev, token_mask, dispatch)[0], moe_params,
                      lambda x: hf_layer.mlp(x, prev_t)[0], hf_layer.mlp, x_np, args.repeats)

    print(json.dumps({
        "config": "bench_small", "platform": jax.default_backend(), "layer": args.layer,
        "tokens": batch * seq, "moe_backend": resolve_moe_backend(args.moe_backend),
        "hf_experts_implementation": hf.config._experts_implementation,
        "hf_attention_implementation": hf.config._attn_implementation,
        "attention": attention_row, "moe": moe_row,
        "torch_threads": torch.get_num_threads(),
    }, indent=2))


if __name__ == "__main__":
    main()
