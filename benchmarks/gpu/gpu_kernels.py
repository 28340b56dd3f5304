"""Pallas kernels on one GPU: correctness against the references, then speed against XLA.

    python -m benchmarks.gpu.gpu_kernels [--out benchmarks/results/gpu_kernels.json]
    python -m benchmarks.gpu.gpu_kernels --smoke    # tiny shapes, interpret mode on CPU, < 1 minute

Prints one JSON object and writes it to --out (rewritten after each section, so a run cut
short still leaves what it measured; progress goes to stderr). Shapes are ZAYA1-base's:
attention with 8 query heads, 2 kv heads, head dim 128, bf16, causal; grouped matmul with 16
experts, hidden 2048 -> 4096 and 2048 -> 2048, moderately uneven groups. Times are medians of
batches of back-to-back calls, one sync per batch, after one compiling call; each records the
launch overhead's share of a call.
`ratio` is kernel TFLOP/s over baseline TFLOP/s (> 1: the kernel is faster); FLOPs are nominal
(causal attention counts half the square; backward = 2.5 x forward), equal for both sides.
A failing check or measurement is recorded as {"error": ...} and the run goes on. The sweep times
alternatives to the platform's default blocks and tiling (pallas_kernels.platform_blocks; bf16 on
cuda: attention fwd 128x64, bwd 64x64, tiling (128, 64, 128)), whose numbers are in the main
sections. Group sizes are jit arguments, as in training.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np


from benchmarks.common import device_time  # noqa: E402
from pallas_kernels import (attention_reference, cca_flash_attention,  # noqa: E402
                            grouped_matmul, grouped_matmul_reference)

HEADS, KV_HEADS, HEAD_DIM, EXPERTS = 8, 2, 128, 16
FULL = {
    "attention": [(2, 4096), (1, 16384)],  # (batch, seq)
    "gmm": [(8192, 2048, 4096), (8192, 2048, 2048), (32768, 2048, 4096), (32768, 2048, 2048)],
    "attention_check": (1, 1000),
    "gmm_check": (3000, 512, 768),
    "sweep_attention": (1, 16384),
    "attention_blocks": [(64, 64, 64, 64), (128, 128, 64, 128), (128, 64, 32, 64)],  # q k q k
    "sweep_gmm": (32768, 2048, 4096),
    "gmm_tilings": [(64, 64, 128), (128, 32, 128), (128, 64, 256)],
    "iters": 10,
}
SMOKE = {
    "attention": [(1, 200)],
    "gmm": [(300, 128, 256)],
    "attention_check": (1, 100),
    "gmm_check": (150, 64, 96),
    "sweep_attention": (1, 200),
    "attention_blocks": [(64, 64, 64, 64)],
    "sweep_gmm": (300, 128, 256),
    "gmm_tilings": [(64, 64, 128)],
    "iters": 2,
}


def guarded(fn: Callable, *args):
    """fn(*args), or {"error": ...} if it raises: one failure must not end a paid GPU run."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {e}"[:500]}


def measure(fn: Callable, args, flops: float, iters: int) -> dict:
    """{"ms", "tflops", "calls_per_sync", "launch_overhead_share"} of `fn(*args)`: the median of `iters`
    batches of back-to-back calls, one sync each (benchmarks.common.device_time)."""
    timed = guarded(device_time, fn, tuple(args), iters)
    if "error" in timed:
        return timed
    seconds = timed["seconds"]
    return {"ms": _sig(seconds * 1e3), "tflops": _sig(flops / seconds / 1e12), "calls_per_sync": timed["calls_per_sync"],
            "launch_overhead_share": _sig(timed["launch_overhead_share"])}


def _sig(x: float) -> float:
    return float(f"{x:.4g}")


def with_ratios(results: dict, kernel: str) -> dict:
    """Adds ratio_vs_<baseline> = kernel TFLOP/s / baseline TFLOP/s where both were measured."""
    for name, r in list(results.items()):
        if name != kernel and "ms" in r and "ms" in results[kernel]:
            results[f"ratio_vs_{name}"] = _sig(r["ms"] / results[kernel]["ms"])
    return results


def fwd_bwd(fn: Callable, num_diff: int | None = None) -> Callable:
    """fn(*xs) -> jitted (*xs, cotangent) -> gradients in the first num_diff xs (default all),
    forward included."""
    def run(*a):
        xs = a[:-1]
        n = len(xs) if num_diff is None else num_diff
        _, vjp = jax.vjp(lambda *d: fn(*d, *xs[n:]), *xs[:n])
        return vjp(a[-1])
    return jax.jit(run)


def value_and_grads(fn: Callable) -> Callable:
    """fn(*xs) -> jitted (*xs, cotangent) -> (fn(*xs), *gradients)."""
    def run(*a):
        out, vjp = jax.vjp(fn, *a[:-1])
        return (out, *vjp(a[-1]))
    return jax.jit(run)


def attention_inputs(batch: int, seq: int, seed: int = 0):
    """bf16 q: [B, S, N, H], k, v: [B, S, M, H], do: [B, S, N, H]."""
    keys = jax.random.split(jax.random.PRNGKey(seed), 4)
    shapes = [(batch, seq, HEADS, HEAD_DIM), (batch, seq, KV_HEADS, HEAD_DIM),
              (batch, seq, KV_HEADS, HEAD_DIM), (batch, seq, HEADS, HEAD_DIM)]
    return [jax.random.normal(key, shape, jnp.float32).astype(jnp.bfloat16)
            for key, shape in zip(keys, shapes, strict=True)]


def uneven_group_sizes(tokens: int, seed: int = 0) -> jax.Array:
    """[EXPERTS] int32 summing to tokens, Dirichlet(4) proportions (about 0.5x-2x the mean)."""
    p = np.random.default_rng(seed).dirichlet(np.full(EXPERTS, 4.0))
    sizes = np.floor(p * tokens).astype(np.int32)
    sizes[-1] += tokens - sizes.sum()
    return jnp.asarray(sizes)


def gmm_inputs(tokens: int, k: int, n: int, seed: int = 0):
    """bf16 lhs: [m, k], rhs: [EXPERTS, k, n] (scaled by 1/sqrt(k)), grad: [m, n]."""
    keys = jax.random.split(jax.random.PRNGKey(seed), 3)
    lhs = jax.random.normal(keys[0], (tokens, k), jnp.float32).astype(jnp.bfloat16)
    rhs = jax.random.normal(keys[1], (EXPERTS, k, n), jnp.float32) * k ** -0.5
    rhs = rhs.astype(jnp.bfloat16)
    grad = jax.random.normal(keys[2], (tokens, n), jnp.float32).astype(jnp.bfloat16)
    return lhs, rhs, grad


def max_errors(names, got, want) -> dict:
    """Per output: max |got - want| and that over max |want|."""
    out = {}
    for name, g, w in zip(names, got, want, strict=True):
        err = float(jnp.max(jnp.abs(g.astype(jnp.float32) - w.astype(jnp.float32))))
        scale = float(jnp.max(jnp.abs(w.astype(jnp.float32))))
        out[name] = {"max_abs_err": err, "rel_to_max": err / max(scale, 1e-30)}
    out["ok"] = all(v["rel_to_max"] < 2e-2 for v in out.values())
    return out


def check_attention(batch: int, seq: int) -> dict:
    """bf16, causal, packed documents, seq not a multiple of the blocks; fp32 reference."""
    q, k, v, do = attention_inputs(batch, seq, seed=1)
    ids = np.cumsum(np.random.default_rng(0).random((batch, seq)) < 4.0 / seq, axis=1)
    segment_ids = jnp.asarray(ids, jnp.int32)
    kernel = functools.partial(cca_flash_attention, segment_ids=segment_ids)
    reference = functools.partial(attention_reference, segment_ids=segment_ids)
    got = value_and_grads(kernel)(q, k, v, do)
    want = value_and_grads(reference)(*[x.astype(jnp.float32) for x in (q, k, v, do)])
    return {"shape": [batch, seq, HEADS, KV_HEADS, HEAD_DIM],
            **max_errors(("out", "dq", "dk", "dv"), got, want)}


def check_gmm(tokens: int, k: int, n: int) -> dict:
    """bf16, uneven groups with an empty one and 37 rows past the last group; fp32 reference."""
    sizes = np.array(uneven_group_sizes(tokens - 37, seed=1))
    sizes[3], sizes[4] = 0, sizes[4] + sizes[3]
    group_sizes = jnp.asarray(sizes)
    lhs, rhs, grad = gmm_inputs(tokens, k, n, seed=1)
    kernel = functools.partial(grouped_matmul, group_sizes=group_sizes)
    reference = functools.partial(grouped_matmul_reference, group_sizes=group_sizes)
    got = value_and_grads(kernel)(lhs, rhs, grad)
    want = value_and_grads(reference)(*[x.astype(jnp.float32) for x in (lhs, rhs, grad)])
    return {"shape": [tokens, k, n, EXPERTS], **max_errors(("out", "d_lhs", "d_rhs"), got, want)}


def attention_flops(batch: int, seq: int) -> float:
    return 4.0 * batch * HEADS * seq * seq * HEAD_DIM / 2  # causal forward


def bench_attention(batch: int, seq: int, iters: int, on_gpu: bool) -> dict:
    q, k, v, do = attention_inputs(batch, seq)
    impls = {"pallas": cca_flash_attention,
             "xla": functools.partial(jax.nn.dot_product_attention, is_causal=True,
                                      implementation="xla")}
    if on_gpu:
        impls["cudnn"] = functools.partial(jax.nn.dot_product_attention, is_causal=True,
                                           implementation="cudnn")
    flops = attention_flops(batch, seq)
    fwd = {name: measure(jax.jit(f), (q, k, v), flops, iters) for name, f in impls.items()}
    both = {name: measure(fwd_bwd(f), (q, k, v, do), 3.5 * flops, iters)
            for name, f in impls.items()}
    return {"batch": batch, "seq": seq, "forward": with_ratios(fwd, "pallas"),
            "forward_backward": with_ratios(both, "pallas")}


def bench_gmm(tokens: int, k: int, n: int, iters: int) -> dict:
    lhs, rhs, grad = gmm_inputs(tokens, k, n)
    group_sizes = uneven_group_sizes(tokens)
    impls = {"pallas": grouped_matmul, "ragged_dot": jax.lax.ragged_dot}
    flops = 2.0 * tokens * k * n
    fwd = {name: measure(jax.jit(f), (lhs, rhs, group_sizes), flops, iters)
           for name, f in impls.items()}
    fwd["dense_dot"] = measure(jax.jit(jnp.dot), (lhs, rhs[0]), flops, iters)
    both = {name: measure(fwd_bwd(f, 2), (lhs, rhs, group_sizes, grad), 3 * flops, iters)
            for name, f in impls.items()}
    both["dense_dot"] = measure(fwd_bwd(jnp.dot), (lhs, rhs[0], grad), 3 * flops, iters)
    return {"tokens": tokens, "k": k, "n": n, "experts": EXPERTS,
            "group_sizes": [int(s) for s in group_sizes],
            "forward": with_ratios(fwd, "pallas"), "forward_backward": with_ratios(both, "pallas")}


def sweep(cfg: dict) -> dict:
    """Alternatives to the default attention blocks and gmm tiling, one large shape each."""
    batch, seq = cfg["sweep_attention"]
    q, k, v, do = attention_inputs(batch, seq)
    flops = attention_flops(batch, seq)
    attention = {}
    for blocks in cfg["attention_blocks"]:
        fn = functools.partial(cca_flash_attention, block_q=blocks[0], block_k=blocks[1],
                               block_q_bwd=blocks[2], block_k_bwd=blocks[3])
        attention[str(blocks)] = {
            "forward": measure(jax.jit(fn), (q, k, v), flops, cfg["iters"]),
            "forward_backward": measure(fwd_bwd(fn), (q, k, v, do), 3.5 * flops, cfg["iters"])}
    tokens, kd, n = cfg["sweep_gmm"]
    lhs, rhs, grad = gmm_inputs(tokens, kd, n)
    group_sizes = uneven_group_sizes(tokens)
    flops = 2.0 * tokens * kd * n
    gmm = {}
    for tiling in cfg["gmm_tilings"]:
        fn = functools.partial(grouped_matmul, tiling=tiling)
        gmm[str(tiling)] = {
            "forward": measure(jax.jit(fn), (lhs, rhs, group_sizes), flops, cfg["iters"]),
            "forward_backward": measure(fwd_bwd(fn, 2), (lhs, rhs, group_sizes, grad), 3 * flops,
                                        cfg["iters"])}
    return {"attention_shape": [batch, seq], "attention_blocks_fwd_q_k_bwd_q_k": attention,
            "gmm_shape": [tokens, kd, n], "gmm_tilings_tm_tk_tn": gmm}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/gpu_kernels.json")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes; runs on CPU in interpret mode")
    parser.add_argument("--skip-sweep", action="store_true",
                        help="leave out the block-size / tiling sweep")
    args = parser.parse_args()
    cfg = SMOKE if args.smoke else FULL
    on_gpu = jax.default_backend() == "gpu"
    if not args.smoke and not on_gpu:
        sys.exit("the full benchmark needs a GPU; use --smoke on CPU")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    start = time.perf_counter()
    result = {"jax": jax.__version__, "backend": jax.default_backend(),
              "device": jax.devices()[0].device_kind, "smoke": args.smoke}
    sections = {
        "check": lambda: {"attention": guarded(check_attention, *cfg["attention_check"]),
                          "gmm": guarded(check_gmm, *cfg["gmm_check"])},
        "attention": lambda: [bench_attention(b, s, cfg["iters"], on_gpu)
                              for b, s in cfg["attention"]],
        "gmm": lambda: [bench_gmm(*shape, cfg["iters"]) for shape in cfg["gmm"]],
    }
    if not args.skip_sweep:
        sections["sweep"] = lambda: sweep(cfg)
    for name, run in sections.items():
        print(f"[{time.perf_counter() - start:6.1f}s] {name}", file=sys.stderr, flush=True)
        result[name] = run()
        result["wall_s"] = round(time.perf_counter() - start, 1)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
