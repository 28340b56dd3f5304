"""Serving under load on one CPU: the engine (continuous batching) against static batching with
zaya_jax.infer.generate_static and with HF transformers' ZayaForCausalLM.generate, on the same requests,
timed in one process. Prints JSON.

  python -m benchmarks.serving.serve_load [--requests 32] [--rates 1,3,12,48] [--slots 8] [--chunk 64] [--no-hf]

Model: configs/bench_small.py in float32 with random weights (Python 3.11: HF's random init, the
same tensors on both sides, as benchmarks/serving/decode.py; Python 3.12, without torch: zaya_jax's own
init, and no transformers server). The work hardly depends on the values (they set only the
MoE routing's balance).

Requests: a fixed seeded set of lengths, prompts of 16-256 tokens and 16-96 output tokens each,
greedy, eos ignored so that every response is as long as asked. Each rate gets the same lengths
with fresh random token ids (seeded by the rate's index), so no prompt shares a block with an
earlier rate's: the engine's prefix cache (on) finds nothing to reuse (its hits per rate are in
the results; an earlier version served the same prompts at every rate, and from the second rate on
the engine restored them from its cache). Arrivals: a Poisson process at each rate (requests/s;
the same exponential draws scaled by 1/rate, so the order is the same at every rate).
Each rate is served three times, one server after the other:

- engine: zaya_jax.engine.Engine(slots N, chunk C, prefix cache on, decode blocks of up to 8
  steps, warmed up), run by
  engine.start() while this thread submits each request at its arrival time; each token is
  timestamped by the request's on_token callback, which the engine calls on its own thread right
  after putting the token in the request's events queue (the queue's Finished ends the wait).
- static: requests in arrival order in batches of up to N: a batch starts when the previous one
  has finished, with every request that has arrived by then (at most N; if none has, at the next
  arrival). One generate_static call per batch, its on_token hook timestamping each column. The
  batch is padded to N rows (one-token dummy rows); generate pads the prompts to its own bucket
  (PROMPT_BUCKET = 16, so 16 widths up to 256) and every call generates max_new_tokens = 96, the
  longest a request may ask, as a static server configured with that maximum does (a request's
  columns past its own length are computed and dropped; `decode_columns_used` is the share of
  the N x 96 columns that were asked for). The 16 compiled shapes are each compiled in a warm-up
  call before any timing (each is two programs of 3-8 s here: widths and lengths bucketed finer
  would multiply them).
- transformers (Python 3.11 only): the same static batching with ZayaForCausalLM.generate on the
  same weights (its real rows only, left padded with an attention mask, min_new_tokens =
  max_new_tokens = the batch's longest request, greedy), each column timestamped by a transformers
  BaseStreamer (its first put is the prompt and is skipped); one warm-up call first. One torch
  thread (`--torch-threads`): with 2 on this loaded 2-core machine a batch of 5 x 32 new tokens
  took 27 s against 0.6 s with 1 (its OpenMP threads wait on each other when one is descheduled).

Per server and rate: output tokens/s = all output tokens / makespan (first arrival to last
token); time to first token (TTFT) from the request's scheduled arrival; time per output token
(TPOT) per request = (last token - first token) / (n - 1); request latency (E2E) from the
scheduled arrival to the last token; p50 and p99 (numpy percentiles, linear) over requests.
Ratios: engine over static and engine over transformers (throughput; the p99s as engine / other,
so below 1 is the engine better).

Engine sweep: the last rate's requests served again by fresh engines with each `--sweep` setting
(a chunk size C, or C:B for C with prefill_budget B; the prefix cache empty, so no hits), against
that rate's static run.

Prefix cache: the TTFT of one request (a 1,000-token prefix + 24 tokens, one output token) on an
engine with the prefix cache on, right after a request with the same prefix and another suffix
(its blocks restored), against the same request on a fresh engine with the cache off; the cache-on
engine's first request (a miss) is reported too. Both engines serve with start(), are warmed up,
and are timed alternately, `--repeats` times with a new prefix each time; medians.

Where an engine step's time goes (`step_split_ms`, medians on the machine state of the run, in
ms; random token ids, as the MoE's work depends on how many experts a call's tokens reach):
`engine.step()` with all N slots decoding, per decode step (its time over the tokens it
made, times N), in blocks of 8 steps and one step at a time (decode_block=1); the jitted
`engine_decode` running one step alone; `extend` + argmax alone; `pick` alone with every row
greedy and with every row sampling (temperature 1, top_p 0.9); and `engine_chunk` for one
prompt chunk, gathered into a 1-row call, alone and with the other N - 1 slots decoding a token
in the same call (against the chunk alone plus `engine_decode`'s one step, what it replaced),
and the [N,C] call with all N rows prefilling.

The issue's goals are reported, not asserted: engine throughput >= 2x static at no worse p99 TTFT
and p99 TPOT (and, read as request latency, at no worse p99 TTFT and E2E: both are reported), >= 5x
transformers, and the cached 1k-prefix TTFT <= 0.2x the uncached one.
Every timed phase records the 1-minute load average at its start and end (other jobs share the
machine).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import queue
import time

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from benchmarks.common import stack  # noqa: E402
from benchmarks.training.hf_pair import bench_small  # noqa: E402
from zaya_jax.engine import Engine, Finished, SamplingParams  # noqa: E402
from zaya_jax.engine.step import STOP_IDS, RowSampling, engine_chunk, engine_decode, pick  # noqa: E402
from zaya_jax.infer.cache import empty_state  # noqa: E402
from zaya_jax.infer.decode import extend  # noqa: E402
from zaya_jax.infer.static_loop import PROMPT_BUCKET, generate_static  # noqa: E402
from zaya_jax.model.zaya import ZayaLM  # noqa: E402

PROMPT_LENS, OUTPUT_LENS = (16, 256), (16, 96)
PREFIX_LEN, SUFFIX_LEN = 1000, 24


def load() -> float:
    return round(os.getloadavg()[0], 2)


def make_requests(count: int, vocab_size: int, ids_seed: int = 0) -> list[tuple[np.ndarray, int]]:
    """-> [(prompt ids, output tokens)]: lengths uniform in PROMPT_LENS and OUTPUT_LENS, the same for
    every ids_seed; token ids drawn with ids_seed."""
    lengths = np.random.default_rng(0)
    shape = [(int(lengths.integers(PROMPT_LENS[0], PROMPT_LENS[1] + 1)),
              int(lengths.integers(OUTPUT_LENS[0], OUTPUT_LENS[1] + 1))) for _ in range(count)]
    ids = np.random.default_rng([ids_seed, 1])
    return [(ids.integers(3, vocab_size, prompt), output) for prompt, output in shape]


def arrivals(count: int, rate: float, seed: int = 1) -> np.ndarray:
    """Poisson arrival times (s) at `rate` requests/s, the first at 0."""
    gaps = np.random.default_rng(seed).exponential(1.0, count)
    return (np.cumsum(gaps) - gaps[0]) / rate


def wait_until(t0: float, offset: float) -> None:
    delay = t0 + offset - time.perf_counter()
    if delay > 0:
        time.sleep(delay)


def summarize(requests, arrive: np.ndarray, times: list[list[float]], load_start: float) -> dict:
    """Throughput, TTFT and TPOT of one served load (times: each request's token times, s from t0)."""
    for (_, n), t in zip(requests, times):
        assert len(t) == n, f"a request asked {n} tokens and got {len(t)}"
    tokens = sum(len(t) for t in times)
    makespan = max(t[-1] for t in times)
    ttft = np.array([t[0] - a for t, a in zip(times, arrive)])
    tpot = np.array([(t[-1] - t[0]) / (len(t) - 1) for t in times])
    e2e = np.array([t[-1] - a for t, a in zip(times, arrive)])

    def pct(x, q):
        return round(float(np.percentile(x, q)), 4)
    return {"output_tokens": tokens, "makespan_s": round(makespan, 3), "tokens_per_s": round(tokens / makespan, 1),
            "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99), "tpot_p50_s": pct(tpot, 50),
            "tpot_p99_s": pct(tpot, 99), "e2e_p50_s": pct(e2e, 50), "e2e_p99_s": pct(e2e, 99),
            "load_average_1m": [load_start, load()]}


def serve_engine(engine: Engine, requests, arrive: np.ndarray) -> list[list[float]]:
    """Submit each request at its arrival while engine.start() runs -> each request's token times."""
    times: list[list[float]] = [[] for _ in requests]
    events = [queue.Queue() for _ in requests]
    engine.start()
    t0 = time.perf_counter()
    for i, (prompt, n) in enumerate(requests):
        wait_until(t0, arrive[i])
        engine.submit(prompt, SamplingParams(max_tokens=n, ignore_eos=True), events=events[i],
                      on_token=lambda _, __, i=i: times[i].append(time.perf_counter() - t0))
    for q in events:
        while not isinstance(q.get(), Finished):
            pass
    engine.stop()
    return times


def serve_static(requests, arrive: np.ndarray, slots: int, run_batch) -> tuple[list[list[float]], list[int]]:
    """Static batching: run_batch(batch requests, stamp) serves one batch, calling stamp(column)
    as each new column is out -> each request's token times, the batch sizes."""
    times: list[list[float]] = [[] for _ in requests]
    sizes = []
    t0, start = time.perf_counter(), 0
    while start < len(requests):
        wait_until(t0, arrive[start])
        now = time.perf_counter() - t0
        batch = [i for i in range(start, min(start + slots, len(requests))) if arrive[i] <= now]
        start += len(batch)
        sizes.append(len(batch))

        def stamp(column: int, batch=batch) -> None:
            t = time.perf_counter() - t0
            for i in batch:
                if column < requests[i][1]:
                    times[i].append(t)
        run_batch([requests[i] for i in batch], stamp)
    return times, sizes


def jax_static_batch(model: ZayaLM, slots: int):
    """-> run_batch for serve_static with generate_static (N rows, OUTPUT_LENS[1] new tokens)."""
    cfg = model.config

    def run(batch, stamp):
        width = max(p.size for p, _ in batch)
        ids = np.full((slots, width), cfg.pad_token_id, np.int32)
        ids[:, 0] = cfg.bos_token_id
        lengths = np.ones(slots, np.int32)
        for row, (prompt, _) in enumerate(batch):
            ids[row, :prompt.size], lengths[row] = prompt, prompt.size
        generate_static(model, ids, OUTPUT_LENS[1], lengths=lengths, stop_at_eos=False,
                 on_token=lambda step, _: stamp(int(step)))
    return run


def hf_static_batch(hf):
    """-> run_batch for serve_static with transformers' generate (left padded, its real rows only)."""
    import torch
    from transformers.generation.streamers import BaseStreamer

    class Stamps(BaseStreamer):
        def __init__(self, stamp):
            self.stamp, self.puts = stamp, 0

        def put(self, value):
            if self.puts:  # the first put is the prompt
                self.stamp(self.puts - 1)
            self.puts += 1

        def end(self):
            pass

    def run(batch, stamp):
        width, new = max(p.size for p, _ in batch), max(n for _, n in batch)
        ids = torch.full((len(batch), width), hf.config.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, (prompt, _) in enumerate(batch):
            ids[row, width - prompt.size:], mask[row, width - prompt.size:] = torch.as_tensor(prompt), 1
        with torch.no_grad():
            hf.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                        pad_token_id=hf.config.pad_token_id, streamer=Stamps(stamp))
    return run


def ratios(engine: dict, other: dict) -> dict:
    return {"tokens_per_s": round(engine["tokens_per_s"] / other["tokens_per_s"], 3),
            "ttft_p99": round(engine["ttft_p99_s"] / other["ttft_p99_s"], 3),
            "tpot_p99": round(engine["tpot_p99_s"] / other["tpot_p99_s"], 3),
            "e2e_p99": round(engine["e2e_p99_s"] / other["e2e_p99_s"], 3)}


def first_token_s(engine: Engine, prompt: np.ndarray) -> float:
    """Seconds from submit to the first token out of the events queue (one output token)."""
    events: queue.Queue = queue.Queue()
    start = time.perf_counter()
    engine.submit(prompt, SamplingParams(max_tokens=1, ignore_eos=True), events=events)
    events.get()
    seconds = time.perf_counter() - start
    assert isinstance(events.get(), Finished)
    return seconds


def prefix_ttft(model: ZayaLM, slots: int, chunk: int, repeats: int) -> dict:
    """TTFT of a 1,000-token-prefix request with its prefix cached against a cache-off engine."""
    size = PREFIX_LEN + SUFFIX_LEN
    cached = Engine(model, slots=slots, cache_size=size, chunk=chunk, prefix_cache_bytes=1 << 30)
    plain = Engine(model, slots=slots, cache_size=size, chunk=chunk)
    for engine in (cached, plain):
        engine.warm_up()
        engine.start()
    rng = np.random.default_rng(2)
    load_start, times = load(), {"miss_cache_on": [], "hit": [], "cache_off": []}
    for _ in range(repeats):
        prefix = rng.integers(3, model.config.vocab_size, PREFIX_LEN)
        first, second = (np.concatenate([prefix, rng.integers(3, model.config.vocab_size, SUFFIX_LEN)])
                         for _ in range(2))
        times["miss_cache_on"].append(first_token_s(cached, first))
        times["hit"].append(first_token_s(cached, second))
        times["cache_off"].append(first_token_s(plain, second))
    stats = cached.stats()
    for engine in (cached, plain):
        engine.stop()
    median = {k: float(np.median(v)) for k, v in times.items()}
    return {"prefix_tokens": PREFIX_LEN, "suffix_tokens": SUFFIX_LEN, "repeats": repeats,
            "cache_size": size, "times_s": {k: [round(t, 4) for t in v] for k, v in times.items()},
            **{f"ttft_{k}_median_s": round(v, 4) for k, v in median.items()},
            "hit_over_cache_off": round(median["hit"] / median["cache_off"], 3),
            "tokens_reused": stats["prefix_tokens_reused"], "prefix_hits": stats["prefix_hits"],
            "load_average_1m": [load_start, load()]}


def median_ms(fn, repeats: int = 20) -> float:
    """Median ms of fn() (which blocks) over `repeats` calls after one."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return round(1000 * float(np.median(times)), 2)


def step_split(engine: Engine, model: ZayaLM, slots: int, chunk: int, cache_size: int) -> dict:
    """ms of an engine step with every slot decoding, and of its parts (see the docstring)."""
    load_start = load()
    split = {}
    vocab = model.config.vocab_size
    ids = np.random.default_rng(4)
    for name, block in (("engine.step_per_decode_step_block8", 8), ("engine.step_per_decode_step_single", 1)):
        engine.decode_block = block
        for i in range(slots):
            engine.submit(ids.integers(3, vocab, PROMPT_LENS[0]), SamplingParams(max_tokens=OUTPUT_LENS[1], ignore_eos=True))
        while engine.stats()["generated_tokens"] < slots or engine.stats()["waiting"]:
            engine.step()
        times = []
        for _ in range(8):
            made, start = engine.stats()["generated_tokens"], time.perf_counter()
            engine.step()
            times.append((time.perf_counter() - start) / (engine.stats()["generated_tokens"] - made) * slots)
        split[name] = round(1000 * float(np.median(times)), 2)
        while engine.has_work():
            engine.step()
    engine.decode_block = 8
    graphdef, params = nnx.split(model)
    state = [empty_state(model.config, slots, cache_size)]
    zeros = np.zeros(slots, np.int32)
    feed = ids.integers(3, vocab, slots).astype(np.int32)
    rows = RowSampling(np.zeros(slots, np.float32), np.full(slots, vocab, np.int32), np.ones(slots, np.float32),
                       zeros.astype(np.uint32), zeros, zeros)
    sampling = rows._replace(temperature=np.ones(slots, np.float32), top_p=np.full(slots, 0.9, np.float32))
    lengths = np.full(slots, PROMPT_LENS[1], np.int32)
    ones = np.ones(slots, np.int32)

    def run_chunk(rows_in_call: int, decoding: bool = False):
        """An engine_chunk call: rows_in_call slots prefilling a chunk each; with `decoding`, the
        other slots decoding a token in the same call."""
        slots_arg = None if rows_in_call == slots else np.arange(rows_in_call, dtype=np.int32)
        prompt = ids.integers(3, vocab, (rows_in_call, chunk)).astype(np.int32)
        counts = np.full(rows_in_call, chunk, np.int32)
        fed = (np.arange(slots) >= rows_in_call).astype(np.int32) if decoding else zeros
        state[0], picked, decoded = engine_chunk(graphdef, params, state[0], slots_arg, lengths, prompt, counts,
                                                 jax.tree.map(lambda x: x[:rows_in_call], rows), feed, fed, rows,
                                                 top=5)
        jax.block_until_ready((picked, decoded))

    def decode_one():
        state[0], decoded = engine_decode(graphdef, params, state[0], lengths, feed, ones,
                                          np.full((slots, STOP_IDS), -1, np.int32), rows, np.int32(1), top=5, block=8)
        jax.block_until_ready(decoded)

    @jax.jit
    def extend_argmax(params, state, ids, counts):
        logits, _ = extend(nnx.merge(graphdef, params), state._replace(lengths=lengths), ids, counts)
        return jnp.argmax(logits, axis=-1)

    pick_alone = jax.jit(pick, static_argnames="top")
    logits = jnp.asarray(np.random.default_rng(3).normal(size=(slots, vocab)), jnp.float32)
    split.update({
        "engine_decode_one_step": median_ms(decode_one),
        "extend_argmax_decode": median_ms(
            lambda: extend_argmax(params, state[0], feed[:, None], ones).block_until_ready()),
        "pick_greedy": median_ms(lambda: jax.block_until_ready(pick_alone(logits, rows, top=5))),
        "pick_sampling": median_ms(lambda: jax.block_until_ready(pick_alone(logits, sampling, top=5))),
        "engine_chunk_one_row": median_ms(lambda: run_chunk(1), 5),
        "engine_chunk_one_row_beside_decoding": median_ms(lambda: run_chunk(1, decoding=True), 5),
        "engine_chunk_all_rows": median_ms(lambda: run_chunk(slots), 5),
    })
    return {**split, "load_average_1m": [load_start, load()]}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--rates", default="1,3,12,48", help="comma-separated arrival rates, requests/s")
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--sweep", default="128,256,64:64,256:256",
                        help="other engine settings served at the last rate, on fresh engines: chunk sizes C, or "
                             "C:B for C with prefill_budget B, comma-separated ('' for none)")
    parser.add_argument("--repeats", type=int, default=3, help="prefix-cache TTFT repeats")
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers server")
    parser.add_argument("--torch-threads", type=int, default=1)
    args = parser.parse_args()
    load_at_start = load()
    _, cfg = bench_small()
    if importlib.util.find_spec("transformers") is None:
        hf_note = "skipped: this stack has no torch/transformers (Python 3.12's); see the _py311 file"
    else:
        hf_note = "skipped (--no-hf)" if args.no_hf else None
    if hf_note is None:
        from benchmarks.training.hf_pair import same_weights_pair
        hf, model = same_weights_pair(cfg, args.torch_threads)
        hf.eval()
    else:
        model = ZayaLM(cfg, rngs=nnx.Rngs(0))
    requests = make_requests(args.requests, cfg.vocab_size)  # rate i serves make_requests(..., ids_seed=i)
    cache_size = PROMPT_LENS[1] + OUTPUT_LENS[1] - 1
    engine = Engine(model, slots=args.slots, cache_size=cache_size, chunk=args.chunk, prefix_cache_bytes=1 << 30)
    static_run = jax_static_batch(model, args.slots)
    servers = {"engine": lambda requests, arrive: (serve_engine(engine, requests, arrive), None),
               "static": lambda requests, arrive: serve_static(requests, arrive, args.slots, static_run)}
    if hf_note is None:
        servers["transformers"] = lambda requests, arrive: serve_static(requests, arrive, args.slots,
                                                                        hf_static_batch(hf))

    warm_start = time.perf_counter()
    engine.warm_up()
    for width in range(PROMPT_BUCKET, PROMPT_LENS[1] + 1, PROMPT_BUCKET):
        static_run([(np.full(width, cfg.bos_token_id), 1)], lambda _: None)
    if hf_note is None:
        hf_static_batch(hf)(requests[:2], lambda _: None)
    warm_up_s = time.perf_counter() - warm_start

    by_rate = []
    for index, rate in enumerate(map(float, args.rates.split(","))):
        arrive, requests = arrivals(len(requests), rate), make_requests(args.requests, cfg.vocab_size, index)
        prefix_before = engine.stats()
        row = {"rate_per_s": rate, "arrival_span_s": round(float(arrive[-1]), 3)}
        for name, serve in servers.items():
            load_start = load()
            times, sizes = serve(requests, arrive)
            row[name] = summarize(requests, arrive, times, load_start)
            if sizes is not None:
                row[name]["batch_sizes"] = sizes
            if name == "static":
                asked = sum(n for _, n in requests)
                row[name]["decode_columns_used"] = round(asked / (len(sizes) * args.slots * OUTPUT_LENS[1]), 3)
        row["engine"].update({k: engine.stats()[k] - prefix_before[k] for k in ("prefix_hits", "prefix_tokens_reused")})
        row["engine_over_static"] = ratios(row["engine"], row["static"])
        if hf_note is None:
            row["engine_over_transformers"] = ratios(row["engine"], row["transformers"])
        by_rate.append(row)
    sweep = []
    for setting in [s for s in args.sweep.split(",") if s]:
        chunk, _, budget = setting.partition(":")
        chunk, budget = int(chunk), int(budget) if budget else None
        other = Engine(model, slots=args.slots, cache_size=cache_size, chunk=chunk, prefix_cache_bytes=1 << 30,
                       prefill_budget=budget)
        other.warm_up()
        load_start = load()
        served = summarize(requests, arrive, serve_engine(other, requests, arrive), load_start)
        sweep.append({"chunk": chunk, "prefill_budget": budget, "engine": served,
                      "engine_over_static": ratios(served, by_rate[-1]["static"])})
    split = step_split(engine, model, args.slots, args.chunk, cache_size)
    prefix = prefix_ttft(model, args.slots, args.chunk, args.repeats)

    def goal_2x_static(row, latencies):
        r = row["engine_over_static"]
        return r["tokens_per_s"] >= 2 and all(r[name] <= 1 for name in latencies)
    goals = {
        "engine_2x_static_throughput_at_no_worse_p99": {str(r["rate_per_s"]): goal_2x_static(r, ("ttft_p99", "tpot_p99"))
                                                        for r in by_rate},
        "engine_2x_static_throughput_at_no_worse_p99_ttft_and_e2e": {
            str(r["rate_per_s"]): goal_2x_static(r, ("ttft_p99", "e2e_p99")) for r in by_rate},
        "engine_5x_transformers_throughput": (
            {str(r["rate_per_s"]): r["engine_over_transformers"]["tokens_per_s"] >= 5 for r in by_rate}
            if hf_note is None else hf_note),
        "cached_1k_prefix_ttft_at_most_0.2x_uncached": prefix["hit_over_cache_off"] <= 0.2,
    }
    print(json.dumps({
        "config": "bench_small", "dtype": "float32", "platform": jax.default_backend(), "cpu_count": os.cpu_count(),
        "stack": stack(), "moe_backend": cfg.moe_backend,
        "weights": "HF random init (same tensors on both sides)" if hf_note is None else "zaya_jax random init",
        "requests": {"count": len(requests), "prompt_tokens": PROMPT_LENS, "output_tokens": OUTPUT_LENS,
                     "total_prompt_tokens": int(sum(p.size for p, _ in requests)),
                     "total_output_tokens": sum(n for _, n in requests), "sampling": "greedy, eos ignored"},
        "engine": {"slots": args.slots, "chunk": args.chunk, "cache_size": cache_size,
                   "prefix_cache_bytes": 1 << 30},
        "static": {"batch_rows": args.slots, "prompt_width_bucket": PROMPT_BUCKET, "max_new_tokens": OUTPUT_LENS[1]},
        "transformers": {"torch_threads": args.torch_threads, "timing": "a BaseStreamer stamps each column"}
        if hf_note is None else hf_note,
        "warm_up_s": round(warm_up_s, 1),
        "by_rate": by_rate, "engine_sweep_at_last_rate": sweep, "step_split_ms": split, "prefix_cache": prefix, "goals": goals,
        "load_average_1m": [load_at_start, load()],  # start, end: other jobs share the machine
    }, indent=2))


if __name__ == "__main__":
    main()
