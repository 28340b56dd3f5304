"""Train-step tokens/s of configs/bench_small.py: zaya_jax against HF transformers' ZayaForCausalLM
with torch.optim.AdamW, on the same CPU, same weights and tokens, timed alternately. Prints JSON.

  python -m benchmarks.training.train_step [--repeats 5] [--muon] [--versus-moe-backend tiles]

One train step = forward, backward and an AdamW update on a batch of 8 x 256 tokens. Ours is the
trainer's own jitted step, its state donated as the trainer donates it (zaya_jax.train.step: chunked fused loss, router balancing controller,
global-norm clipping, non-finite check). The breakdown times each part on its own with the same
shapes (attention and MoE: one layer's forward+backward, times the layer count; loss head:
output projection + cross-entropy forward+backward; optimizer: the AdamW update), so the next
bottleneck is visible; `other` is the step minus those parts. --muon adds our Muon step's time;
--versus-moe-backend B times our step with MoE backend B alternately with the default one.
What stays between each side and the machine: the step's matmul FLOPs (the planner's count,
zaya_jax.planner.step_flops, within 7% of XLA's own count in planner_flops_vs_xla_cpu.json) over
its time, against the float32 matmul peak measured in the same process (common.matmul_peak_gflops);
`step_s_at_matmul_peak` is the step's matmuls alone at that peak, and
`max_speedup_vs_hf_at_matmul_peak` what HF's time over it allows.
The process starts with the train CLI's launch defaults (zaya_jax.launch_defaults), which torch's
side shares.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
from typing import Callable


if __name__ == "__main__":  # as the train CLI starts (both sides share the process's heap settings)
    from zaya_jax import launch_defaults
    launch_defaults.apply()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import torch  # noqa: E402
from flax import nnx  # noqa: E402

from benchmarks.common import alternate_times, matmul_peak_gflops, median_time  # noqa: E402
from benchmarks.training.hf_pair import bench_small, same_weights_pair  # noqa: E402
from zaya_jax.model.kernels import attention_fn, moe_dispatch_fn, resolve_moe_backend  # noqa: E402
from zaya_jax.model.rope import rope_cos_sin  # noqa: E402
from zaya_jax.planner.step_flops import step_flops  # noqa: E402
from zaya_jax.train import balancing  # noqa: E402
from zaya_jax.train.loss import chunked_nll_sum  # noqa: E402
from zaya_jax.train.optimizer import make_optimizer  # noqa: E402
from zaya_jax.train.settings import settings_from_config  # noqa: E402
from zaya_jax.checkpoints.model_parts import ModelParts  # noqa: E402
from zaya_jax.train.state import initial_state  # noqa: E402
from zaya_jax.train.step import train_step  # noqa: E402


def blocking(fn):
    return lambda: jax.block_until_ready(fn())


def grad_time(fn, args, repeats: int) -> float:
    """Median seconds of forward+backward of sum(fn(*args)) with respect to every argument."""
    step = jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a)), argnums=tuple(range(len(args)))))
    return median_time(blocking(lambda: step(*args)), repeats)


def breakdown(model, settings, batch, tx, repeats: int) -> dict[str, float]:
    cfg = model.config
    b, s = batch["inputs"].shape
    layer_def, layer_states = nnx.split(model.layers)
    layer = nnx.merge(layer_def, jax.tree.map(lambda x: x[0], layer_states))
    x = jax.random.normal(jax.random.key(1), (b, s, cfg.hidden_size))
    cos, sin = rope_cos_sin(jnp.asarray(batch["positions"]), cfg.rotary_dim, cfg.rope_theta)
    seg = jnp.asarray(batch["segment_ids"])
    attn_def, attn_state = nnx.split(layer.attention)
    moe_def, moe_state = nnx.split(layer.moe)
    attention, dispatch = attention_fn(cfg), moe_dispatch_fn(cfg)
    router_state = jnp.zeros((b, s, cfg.router_hidden_size))

    def attn(p, x):
        return nnx.merge(attn_def, p)(x, cos, sin, seg, attention)

    def moe(p, x):
        return nnx.merge(moe_def, p)(x, router_state, seg > 0, dispatch)[0]

    def head(embed, h):
        return chunked_nll_sum(lambda c: jnp.einsum("bcd,vd->bcv", c, embed), h, jnp.asarray(batch["targets"]),
                               jnp.asarray(batch["loss_mask"]), settings.train.loss_chunk_size)

    params, _ = ModelParts.arrays(model)
    opt_state = tx.init(params)
    update = jax.jit(lambda g, st, p: optax.apply_updates(p, tx.update(g, st, p)[0]))
    return {
        "attention_s": cfg.num_layers * grad_time(attn, (attn_state, x), repeats),
        "moe_s": cfg.num_layers * grad_time(moe, (moe_state, x), repeats),
        "loss_head_s": grad_time(head, (model.embed[...], x), repeats),
        "optimizer_s": median_time(blocking(lambda: update(params, opt_state, params)), repeats),
    }


def jax_step_fn(model, settings, tx):
    """-> (initial state, jitted step) as the trainer compiles it: the state is donated (updated in
    place, as torch's optimizer updates its parameters), so each call needs the previous call's state."""
    parts = ModelParts(model)
    controller = balancing.make_controller(settings.balancing)
    params, biases = ModelParts.arrays(model)
    # a private copy of every leaf: donation must not reach the model's arrays or shared zeros
    state = jax.tree.map(jnp.copy, initial_state(params, biases, tx, controller, settings.train.seed))
    step = jax.jit(functools.partial(
        train_step, parts=parts, tx=tx, controller=controller, lr_schedule=lambda count: 0.0,
        rope_theta=model.config.rope_theta, microbatches=1, loss_chunk=settings.train.loss_chunk_size,
        balance=settings.balancing.enabled, include_skip=False, mesh=None), donate_argnums=0)
    return state, step


def repeated_step(state, step, batch) -> Callable[[], dict]:
    """-> a blocking call running `step` once more on its own previous state; returns its metrics."""
    holder = {"state": state}

    def run():
        holder["state"], metrics = step(holder["state"], batch)
        return jax.block_until_ready(metrics)
    return run


def hf_and_jax_steps(moe_backend: str = "auto"):
    """bench_small's HF (transformers + torch AdamW) and zaya_jax (AdamW) train steps on the same
    weights and tokens -> (jax_step, torch_step, context): blocking calls; context holds the
    pieces main() reports on (model, settings, batch, optimizer, dropped/routed counters)."""
    config, cfg = bench_small(moe_backend)
    settings = settings_from_config(config)
    batch_size, seq = settings.train.global_batch_size, settings.train.seq_len
    hf, model = same_weights_pair(cfg, os.cpu_count())
    hf_opt = torch.optim.AdamW(hf.parameters(), lr=settings.optimizer.learning_rate,
                               betas=(settings.optimizer.b1, settings.optimizer.b2), eps=settings.optimizer.eps,
                               weight_decay=settings.optimizer.weight_decay)
    ids = np.random.default_rng(0).integers(3, cfg.vocab_size, (batch_size, seq + 1)).astype(np.int32)
    batch = {"inputs": ids[:, :-1], "targets": ids[:, 1:], "segment_ids": np.ones((batch_size, seq), np.int32),
             "positions": np.broadcast_to(np.arange(seq, dtype=np.int32), (batch_size, seq)).copy(),
             "loss_mask": np.ones((batch_size, seq), np.float32)}
    ids_t = torch.as_tensor(ids[:, :-1].astype(np.int64))  # HF shifts the labels itself (S-1 predictions)
    adamw = make_optimizer(settings.optimizer, settings.train.steps)
    run = repeated_step(*jax_step_fn(model, settings, adamw), jax.device_put(batch))
    context = {"model": model, "settings": settings, "batch": batch, "optimizer": adamw, "dropped": 0, "routed": 0}

    def jax_step():
        metrics = run()
        context["dropped"] += int(metrics["dropped"].sum())  # tokens a capacity backend dropped, all layers
        context["routed"] += int(metrics["expert_counts"].sum())

    def torch_step():
        hf_opt.zero_grad(set_to_none=True)
        hf(ids_t, labels=ids_t).loss.backward()
        hf_opt.step()
    return jax_step, torch_step, context


def matmul_gflop_per_step(settings) -> float:
    """The AdamW step's forward and backward matmul GFLOP on one device (the planner's count)."""
    single = dict(data=1, fsdp=1, expert=1, tensor=1, context=1)
    flops = step_flops(settings.model, single, global_batch=settings.train.global_batch_size,
                       seq_len=settings.train.seq_len, microbatches=1, platform="cpu", optimizer_matrices=[],
                       ns_steps=settings.optimizer.muon_ns_steps, loss_chunk=settings.train.loss_chunk_size)
    return sum(flops.values()) / 1e9


def against_matmul_peak(gflop: float, jax_s: float, torch_s: float) -> dict[str, float]:
    peak = matmul_peak_gflops()
    return {"matmul_peak_gflops": round(peak, 1), "step_matmul_gflop": round(gflop, 2),
            "zaya_jax_matmul_gflops": round(gflop / jax_s, 1), "hf_torch_matmul_gflops": round(gflop / torch_s, 1),
            "zaya_jax_fraction_of_peak": round(gflop / jax_s / peak, 3),
            "hf_torch_fraction_of_peak": round(gflop / torch_s / peak, 3),
            "step_s_at_matmul_peak": round(gflop / peak, 4),
            "max_speedup_vs_hf_at_matmul_peak": round(torch_s / (gflop / peak), 3)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--muon", action="store_true", help="also time the Muon + AdamW step")
    parser.add_argument("--versus-moe-backend", help="also time our step with this MoE backend, alternately")
    args = parser.parse_args()
    load_start = os.getloadavg()[0]  # the CPU is shared: other jobs' load skews both sides, torch more
    jax_step, torch_step, context = hf_and_jax_steps()
    model, settings, batch, adamw = (context[k] for k in ("model", "settings", "batch", "optimizer"))
    jax_times, torch_times = alternate_times(jax_step, torch_step, args.repeats)
    jax_t, torch_t = statistics.median(jax_times), statistics.median(torch_times)
    tokens = batch["inputs"].size
    parts = breakdown(model, settings, batch, adamw, args.repeats)
    parts["other_s"] = jax_t - sum(parts.values())
    result = {
        "config": "bench_small", "platform": jax.default_backend(), "tokens_per_step": tokens,
        "optimizer": "adamw (both)", "moe_backend": resolve_moe_backend(model.config.moe_backend),
        "drop_rate": context["dropped"] / context["routed"],
        "zaya_jax_s_per_step": round(jax_t, 4), "hf_torch_s_per_step": round(torch_t, 4),
        "zaya_jax_tokens_per_s": round(tokens / jax_t, 1), "hf_torch_tokens_per_s": round(tokens / torch_t, 1),
        "speedup_vs_hf": round(torch_t / jax_t, 3),
        "zaya_jax_best_s": round(min(jax_times), 4), "hf_torch_best_s": round(min(torch_times), 4),
        "speedup_vs_hf_best": round(min(torch_times) / min(jax_times), 3),
        "zaya_jax_breakdown_s": {k: round(v, 4) for k, v in parts.items()},
        **against_matmul_peak(matmul_gflop_per_step(settings), jax_t, torch_t),
        "torch_threads": torch.get_num_threads(),
        "load_average_1min_start_end": [round(load_start, 2), round(os.getloadavg()[0], 2)],
    }
    if args.versus_moe_backend:
        other = nnx.clone(model)
        other.config = model.config.replace(moe_backend=args.versus_moe_backend)
        ours, theirs = alternate_times(jax_step, repeated_step(*jax_step_fn(other, settings, adamw), batch),
                                       args.repeats)
        result[f"zaya_jax_s_per_step_{args.versus_moe_backend}_vs_{result['moe_backend']}"] = [
            round(statistics.median(theirs), 4), round(statistics.median(ours), 4)]
        result["load_average_1min_start_end"][1] = round(os.getloadavg()[0], 2)
    if args.muon:
        muon_settings = settings.optimizer.__class__(**{**vars(settings.optimizer), "name": "muon"})
        muon = repeated_step(*jax_step_fn(model, settings, make_optimizer(muon_settings, settings.train.steps)), batch)
        result["zaya_jax_muon_s_per_step"] = round(median_time(muon, args.repeats), 4)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
