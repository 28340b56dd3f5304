"""Generation speed of configs/bench_small.py: the static loop (generate_static) against HF transformers'
ZayaForCausalLM.generate (PyTorch, its ZAYA cache) on the same CPU, same weights, greedy, timed
alternately. Prints JSON.

  python -m benchmarks.serving.decode [--batch 1,8] [--prompt-len 128] [--new-tokens 64] [--repeats 3]

For each side: prefill_s = generate(max_new_tokens=1) (the prompt pass and one token), total_s =
generate(max_new_tokens=N) with eos ignored (HF: min_new_tokens=N), decode tokens/s =
B * (N - 1) / (total_s - prefill_s). Weights: HF's random init of the bench_small shape (the
same tensors converted into zaya_jax); the work does not depend on the values.
Against the machine: prefill's and decoding's matmul FLOPs (2 per active weight per token, the
attention scores and values over the keys, the output head once per sequence in prefill) over
their times, as fractions of the float32 matmul peak measured in the same process
(common.matmul_peak_gflops); decoding also reports the bytes of the weights one step reads at
least (every non-embedding weight a token uses and the output head) and the rate it reads them.
"""

from __future__ import annotations

import argparse
import json
import os

import jax  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.common import matmul_peak_gflops, wall_time  # noqa: E402
from benchmarks.training.hf_pair import bench_small, same_weights_pair  # noqa: E402
from zaya_jax.infer import generate_static  # noqa: E402
from zaya_jax.model.accounting import model_summary  # noqa: E402


def matmul_gflop(cfg, weights: int, tokens: int, key_sum: float, head_rows: int) -> float:
    """Forward matmul GFLOP of `tokens` tokens of one sequence (`weights` active non-embedding
    weights) that attend to `key_sum` keys in all, with the output head on `head_rows` of them."""
    attention = 2 * 2 * cfg.num_q_heads * cfg.head_dim * key_sum * cfg.num_layers
    return (2 * weights * tokens + attention + 2 * cfg.hidden_size * cfg.vocab_size * head_rows) / 1e9


def against_matmul_peak(cfg, row: dict, peak: float) -> dict:
    """Prefill (the prompt, causal; the head on its last token) and one decoding step (one token
    per sequence attending to the prompt and half the new tokens, on average) against the peak."""
    b, s, n = row["batch"], row["prompt_len"], row["new_tokens"]
    weights = model_summary(cfg)["params_active_non_embedding"]
    prefill = b * matmul_gflop(cfg, weights, s, s * (s + 1) / 2, 1)
    step = b * matmul_gflop(cfg, weights, 1, s + n / 2, 1)
    steps_per_s = row["zaya_jax_decode_tokens_per_s"] / b
    weight_mb = 4 * (weights + cfg.hidden_size * cfg.vocab_size) / 1e6
    return {"matmul_peak_gflops": round(peak, 1), "prefill_matmul_gflop": round(prefill, 3),
            "zaya_jax_prefill_fraction_of_peak": round(prefill / row["zaya_jax_prefill_s"] / peak, 3),
            "hf_torch_prefill_fraction_of_peak": round(prefill / row["hf_torch_prefill_s"] / peak, 3),
            "decode_step_matmul_gflop": round(step, 4),
            "zaya_jax_decode_fraction_of_peak": round(step * steps_per_s / peak, 3),
            "decode_step_weight_mb_at_least": round(weight_mb, 1),
            "zaya_jax_decode_weight_gb_per_s": round(weight_mb * steps_per_s / 1e3, 1)}


def measure(model, hf, vocab_size: int, batch: int, prompt_len: int, n: int, repeats: int) -> dict:
    prompts = np.random.default_rng(batch).integers(3, vocab_size, (batch, prompt_len))
    prompts_t = torch.as_tensor(prompts)
    mask = torch.ones_like(prompts_t)

    def ours(new):
        return generate_static(model, prompts, new, stop_at_eos=False)

    def theirs(new):
        with torch.no_grad():
            out = hf.generate(prompts_t, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False)
        return out[:, prompt_len:].numpy()

    agree = float(np.mean(ours(n) == theirs(n)))  # also compiles / warms up both lengths
    ours(1), theirs(1)
    times = {key: [] for key in ("ours_prefill", "ours_total", "hf_prefill", "hf_total")}
    for _ in range(repeats):  # alternate so both see the same machine state
        times["ours_prefill"].append(wall_time(lambda: ours(1)))
        times["hf_prefill"].append(wall_time(lambda: theirs(1)))
        times["ours_total"].append(wall_time(lambda: ours(n)))
        times["hf_total"].append(wall_time(lambda: theirs(n)))
    t = {key: float(np.median(v)) for key, v in times.items()}
    ours_tps = batch * (n - 1) / (t["ours_total"] - t["ours_prefill"])
    hf_tps = batch * (n - 1) / (t["hf_total"] - t["hf_prefill"])
    return {
        "batch": batch, "prompt_len": prompt_len, "new_tokens": n,
        "zaya_jax_prefill_s": round(t["ours_prefill"], 4), "hf_torch_prefill_s": round(t["hf_prefill"], 4),
        "zaya_jax_decode_tokens_per_s": round(ours_tps, 1), "hf_torch_decode_tokens_per_s": round(hf_tps, 1),
        "prefill_speedup_vs_hf": round(t["hf_prefill"] / t["ours_prefill"], 3),
        "decode_speedup_vs_hf": round(ours_tps / hf_tps, 3),
        "greedy_tokens_equal_to_hf": round(agree, 4),
    }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", default="1,8", help="comma-separated batch sizes")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--torch-threads", type=int, default=os.cpu_count())
    args = parser.parse_args()
    load_at_start = os.getloadavg()[0]
    _, cfg = bench_small()
    hf, model = same_weights_pair(cfg, args.torch_threads)
    hf.eval()
    results = [measure(model, hf, cfg.vocab_size, int(b), args.prompt_len, args.new_tokens, args.repeats)
               for b in args.batch.split(",")]
    peak = matmul_peak_gflops()
    results = [{**row, **against_matmul_peak(model.config, row, peak)} for row in results]
    print(json.dumps({
        "config": "bench_small", "weights": "HF random init (same tensors on both sides)",
        "platform": jax.default_backend(), "cpu_count": os.cpu_count(),
        "load_average_1m": [round(load_at_start, 2), round(os.getloadavg()[0], 2)],  # start, end: other jobs
        "torch_threads": torch.get_num_threads(),
        "results": results,
    }, indent=2))


if __name__ == "__main__":
    main()
