"""The serving engine (zaya_jax.engine): continuous batching, per-request sampling, exact prefix
caching, cancellation, bounded compilation and argument checks, on a tiny mixed sliding/full model."""

import contextlib
import queue
import types
from typing import Iterator

import jax
import numpy as np
import pytest

from tests.model_fixtures import random_tiny_model
from zaya_jax.config_files import load_config_file, model_config
from zaya_jax.engine import Engine, Finished, SamplingParams
from zaya_jax.engine.prefix_cache import entry_bytes
from zaya_jax.engine import generate

WINDOW = 6
MIXED = dict(layer_types=("hybrid_sliding", "hybrid"), sliding_window=WINDOW, sliding_rope_theta=500.0)
SLOTS, CACHE, CHUNK = 3, 48, 8
MAX_TOKENS = 8
LENGTHS = [3, 11, 20, 5, 9, 17]  # some past C, several past the window


@pytest.fixture(scope="module")
def model():
    return random_tiny_model(**MIXED)


@pytest.fixture(scope="module")
def prompts(model):
    rng = np.random.default_rng(5)
    return [rng.integers(3, model.config.vocab_size, n).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def forward(model):
    step = jax.jit(lambda m, x: jax.nn.log_softmax(m(x), axis=-1))

    def log_probs(tokens: list[int]) -> np.ndarray:
        """[len(tokens), V] log_softmax of the full forward (padded to CACHE: causal, so exact)."""
        ids = np.zeros((1, CACHE), np.int32)
        ids[0, :len(tokens)] = tokens
        return np.asarray(step(model, ids))[0, :len(tokens)]
    return log_probs


def run(engine: Engine, batches: list[list[tuple[list[int], SamplingParams]]]) -> list[tuple[Finished, list]]:
    """Submit each batch one engine step after the previous one, step until all are done -> each
    request's Finished and TokenEvents, in submission order."""
    queues = []
    for batch in batches:
        queues += [submit(engine, p, params) for p, params in batch]
        engine.step()
    while engine.has_work():
        engine.step()
    return [drain(q) for q in queues]


def submit(engine: Engine, prompt: list[int], params: SamplingParams) -> queue.Queue:
    engine.submit(prompt, params, events=(events := queue.Queue()))
    return events


def drain(events) -> tuple[Finished, list]:
    tokens = []
    while not isinstance(event := events.get_nowait(), Finished):
        tokens.append(event)
    return event, tokens


@contextlib.contextmanager
def compilations() -> Iterator[list[float]]:
    """The XLA compilations inside the block: a list of their durations, filled as they happen."""
    compiled = []

    def listen(event, duration, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            compiled.append(duration)
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield compiled
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


def greedy(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, logprobs=True, top_logprobs=3, **kw)


def test_mixed_load_equals_each_request_alone(model, prompts, forward):
    engine = Engine(model, slots=SLOTS, cache_size=CACHE, chunk=CHUNK)
    batches = [[(p, greedy()) for p in prompts[:4]], [], [(prompts[4], greedy())], [(prompts[5], greedy())]]
    done = run(engine, batches)
    for prompt, (finished, events) in zip(prompts, done):
        alone = generate(model, [prompt], MAX_TOKENS)[0].tolist()
        n = len(finished.tokens)
        assert finished.tokens == alone[:n] and (n == MAX_TOKENS or finished.tokens[-1] == model.config.eos_token_id)
        assert finished.reason == ("length" if n == MAX_TOKENS else "stop")
        reference = forward(prompt + finished.tokens)[len(prompt) - 1:-1]
        chosen = reference[np.arange(n), finished.tokens]
        np.testing.assert_allclose(finished.logprobs, chosen, atol=1e-4, rtol=0)
        assert [e.token for e in events] == finished.tokens
        for event, row in zip(events, reference):
            best = np.argsort(-row)[:3]
            assert [t for t, _ in event.top_logprobs] == best.tolist()
            np.testing.assert_allclose([lp for _, lp in event.top_logprobs], row[best], atol=1e-4, rtol=0)
    assert engine.stats()["generated_tokens"] == sum(len(f.tokens) for f, _ in done)
    # a lone arriving prompt's chunks ran gathered into a 1-row call, the first three's in one of 3
    assert engine.calls["chunk", 1] > 0 and engine.calls["chunk", SLOTS] > 0



def test_stop_ids_and_the_stop_predicate_end_a_response(model, prompts):
    engine = Engine(model, slots=SLOTS, cache_size=CACHE, chunk=CHUNK)
    (free, _), = run(engine, [[(prompts[4], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))]])
    assert free.reason == "length" and len(free.tokens) == MAX_TOKENS
    first = free.tokens.index(free.tokens[3])
    by_id, by_predicate = run(engine, [[(prompts[4], SamplingParams(MAX_TOKENS, stop_ids=[free.tokens[3]], ignore_eos=True)),
                                        (prompts[4], SamplingParams(MAX_TOKENS, ignore_eos=True, stop=lambda t: len(t) == 5))]])
    assert by_id[0] == Finished("stop", free.tokens[:first + 1], [])
    assert by_predicate[0] == Finished("stop", free.tokens[:5], [])
    broken, unharmed = run(engine, [[(prompts[4], SamplingParams(MAX_TOKENS, ignore_eos=True, stop=lambda t: t[9])),
                                     (prompts[4], SamplingParams(MAX_TOKENS, ignore_eos=True))]])
    assert broken[0] == Finished("error", free.tokens[:1], []) and unharmed[0] == free

def test_a_decode_block_stops_each_slot_on_device_and_equals_one_step_at_a_time(model, prompts):
    one = Engine(model, slots=SLOTS, cache_size=CACHE, chunk=CHUNK, decode_block=1)
    (free, _), = run(one, [[(prompts[4], SamplingParams(MAX_TOKENS, ignore_eos=True))]])
    stop = free.tokens[3]
    assert 1 <= free.tokens.index(stop) < MAX_TOKENS - 1  # a stop mid-block, after the first (prefill) token
    requests = [(prompts[4], SamplingParams(MAX_TOKENS, stop_ids=[stop], ignore_eos=True, logprobs=True)),
                (prompts[0], SamplingParams(5, ignore_eos=True, logprobs=True, top_logprobs=2)),  # 1 + 4: a block's edge
                (prompts[1], sampled(3)), (prompts[2], greedy()), (prompts[5], sampled(4)._replace(max_tokens=6))]
    blocks = Engine(model, slots=SLOTS, cache_size=CACHE, chunk=CHUNK, decode_block=4)
    made, beside, decode, chunk = [], [], blocks._decode, blocks._chunk

    def recording(*args, **kwargs):
        state, decoded = decode(*args, **kwargs)
        made.append(int(np.asarray(decoded.made).sum()))
        return state, decoded

    def beside_a_chunk(*args, **kwargs):  # a prefill chunk's call decodes one token of each feeding slot
        beside.append(int(np.asarray(args[9]).sum()))
        return chunk(*args, **kwargs)
    blocks._decode, blocks._chunk = recording, beside_a_chunk
    got, want = run(blocks, [requests]), run(one, [requests])
    for (g, g_events), (w, w_events) in zip(got, want):
        assert (g.reason, g.tokens) == (w.reason, w.tokens)
        np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-5, rtol=0)
        assert [[t for t, _ in e.top_logprobs] for e in g_events] == [[t for t, _ in e.top_logprobs] for e in w_events]
    assert got[0][0].reason == "stop" and got[0][0].tokens[-1] == stop and len(got[1][0].tokens) == 5
    assert blocks.calls["decode", 4] > 0  # blocks of 4 steps ran
    # the device made exactly the tokens delivered after each first one: no slot ran past its stop id or max_tokens
    assert sum(made) + sum(beside) == sum(len(f.tokens) - 1 for f, _ in got)
    assert sum(beside) > 0  # slots decoded in the same call as another's prompt chunk


def test_a_host_stop_runs_in_decode_blocks_and_drops_the_tokens_past_it(model, prompts):
    """A stop predicate (what a stop string becomes) no longer makes every call one step: the block
    runs, the host ends the request at the token the predicate names, and the tokens its slot made
    after it are dropped; the responses equal one step at a time's."""
    requests = [(prompts[4], SamplingParams(MAX_TOKENS, ignore_eos=True, stop=lambda t: len(t) == 6)),
                (prompts[1], sampled(3)._replace(stop=lambda t: len(t) == 3, logprobs=True))]
    blocks = Engine(model, slots=SLOTS, cache_size=CACHE, chunk=CHUNK, decode_block=4)
    got = run(blocks, [requests])
    want = run(Engine(model, slots=SLOTS, cache_size=CACHE, chunk=CHUNK, decode_block=1), [requests])
    assert [(f.reason, f.tokens) for f, _ in got] == [(f.reason, f.tokens) for f, _ in want]
    assert [len(f.tokens) for f, _ in got] == [6, 3] and all(f.reason == "stop" for f, _ in got)
    np.testing.assert_allclose(got[1][0].logprobs, want[1][0].logprobs, atol=1e-5, rtol=0)
    assert blocks.calls["decode", 4] > 0


def sampled(seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, top_k=20, top_p=0.9, seed=seed, ignore_eos=True)


def test_a_seeded_sampled_response_does_not_depend_on_the_batch(model, prompts):
    engine = Engine(model, slots=SLOTS, cache_size=CACHE, chunk=CHUNK)
    (alone, _), = run(engine, [[(prompts[2], sampled(7))]])
    among = run(engine, [[(prompts[0], sampled(1)), (prompts[5], greedy())], [(prompts[2], sampled(7))],
                         [(prompts[1], sampled(7))]])
    assert among[2][0].tokens == alone.tokens
    (other_seed, _), = run(engine, [[(prompts[2], sampled(8))]])
    assert other_seed.tokens != alone.tokens


@pytest.fixture(scope="module")
def shared(model):
    """Prompts sharing prefixes of 0-3 blocks of C, and one equal to an earlier one."""
    rng = np.random.default_rng(9)
    base = rng.integers(3, model.config.vocab_size, 30).tolist()
    tail = lambda n: rng.integers(3, model.config.vocab_size, n).tolist()  # noqa: E731
    return [base[:26], base[:17] + tail(3), base[:26], base[:8], base[:9], base + tail(2), tail(12), base[:16] + tail(1)]


def serve_shared(engine: Engine, shared) -> list[Finished]:
    """The first prompt alone, the others two steps later and after."""
    batches = [[(shared[0], greedy())], [], [], [(p, greedy()) for p in shared[1:4]], [(p, greedy()) for p in shared[4:]]]
    return [finished for finished, _ in run(engine, batches)]


@pytest.fixture(scope="module")
def uncached(model, shared):
    return serve_shared(Engine(model, slots=SLOTS, cache_size=CACHE, chunk=CHUNK), shared)


@pytest.mark.parametrize("budget", [1 << 20, 6000])  # ample; two entries of 2,624 bytes
def test_prefix_cache_hits_compute_what_misses_compute(model, shared, uncached, budget):
    engine = Engine(model, slots=SLOTS, cache_size=CACHE, chunk=CHUNK, prefix_cache_bytes=budget)
    cached = serve_shared(engine, shared)
    for i, (hit, miss) in enumerate(zip(cached, uncached)):
        assert hit.tokens == miss.tokens, f"request {i}"
        # float32 rounding apart: a hit prefills fewer chunks, so its chunk calls gather other row
        # buckets ([1,C] against [2,C]...) and its decode blocks hold other rows (1.2e-6 seen)
        np.testing.assert_allclose(hit.logprobs, miss.logprobs, atol=1e-5, rtol=0, err_msg=f"request {i}")
    stats = engine.stats()
    assert stats["prefix_hits"] > 0 and stats["prefix_tokens_reused"] >= CHUNK * stats["prefix_hits"]
    assert stats["prefix_hits"] + stats["prefix_misses"] == len(shared)
    assert 0 < stats["prefix_bytes"] <= budget and (stats["prefix_evictions"] > 0) == (budget < 1 << 20)
    assert stats["prefix_bytes"] == stats["prefix_entries"] * entry_bytes(model.config, CHUNK, CACHE)


def test_a_prefill_budget_caps_each_steps_prompt_tokens_and_changes_no_response(model, prompts, shared, uncached):
    budget = 5  # below C: the earliest prompt's block goes in pieces of 5 and 3, the later prompts wait
    engine = Engine(model, slots=SLOTS, cache_size=CACHE, chunk=CHUNK, prefill_budget=budget,
                    prefix_cache_bytes=1 << 20)
    counts, chunk = [], engine._chunk

    def recording(*args, **kwargs):
        counts.append(np.asarray(args[6]).tolist())  # each row's prompt tokens in this call
        return chunk(*args, **kwargs)
    engine._chunk = recording
    done = run(engine, [[(p, greedy()) for p in prompts[:4]], [], [(prompts[4], greedy())], [(prompts[5], greedy())]])
    for prompt, (finished, _) in zip(prompts, done):
        assert finished.tokens == generate(model, [prompt], MAX_TOKENS)[0].tolist()[:len(finished.tokens)]
    assert max(map(sum, counts)) == budget  # spent, never exceeded
    # step 1: the first prompt's 3 tokens and the second's first 2; then the second's 5 up to its block's end
    assert sorted(counts[0], reverse=True)[:3] == [3, 2, 0][:len(counts[0])] and 5 in counts[1]
    cached = serve_shared(engine, shared)  # pieces end on block boundaries: the prefix cache stores and hits
    assert [f.tokens for f in cached] == [f.tokens for f in uncached] and engine.stats()["prefix_hits"] > 0
    with pytest.raises(ValueError, match="prefill_budget must be a positive integer"):
        Engine(model, slots=SLOTS, cache_size=CACHE, chunk=CHUNK, prefill_budget=0)


def reference_shares(prefilling: list[tuple[int, int, int]], budget: int, chunk: int = CHUNK) -> dict[int, int]:
    """The documented rule on [(admission rank, prompt tokens in, prompt size)] of the requests still
    prefilling -> {rank: its prompt tokens this step}: earliest admitted first, each up to the next
    multiple of `chunk` above what it holds (or its prompt's end), until the budget is spent."""
    shares, left = {}, budget
    for rank, start, size in sorted(prefilling):
        if left == 0:
            break
        end = min((start // chunk + 1) * chunk, size, start + left)
        shares[rank], left = end - start, left - (end - start)
    return shares


def recorded_prefill(engine: Engine, ranks: dict[int, int]) -> list[tuple[list, dict[int, int]]]:
    """Wrap engine._chunk -> per call (the requests still prefilling as [(rank, tokens in, size,
    slot)], {rank: prompt tokens the call gives it}), ranks: request id -> admission rank."""
    calls, chunk = [], engine._chunk

    def recording(*args, **kwargs):
        order = range(engine.slots) if args[3] is None else np.asarray(args[3]).tolist()
        rows = {slot: r for slot, r in enumerate(engine._rows) if r is not None}
        prefilling = [(ranks[r.id], r.prefilled, r.prompt.size, slot) for slot, r in rows.items()
                      if r.prefilled < r.prompt.size]
        given = {ranks[rows[slot].id]: int(n) for slot, n in zip(order, np.asarray(args[6])) if n}
        calls.append((prefilling, given))
        return chunk(*args, **kwargs)
    engine._chunk = recording
    return calls


def test_prefill_shares_match_the_rule_on_many_random_slot_tables():
    """Engine._prefill_shares on 500 random tables: requests admitted in a random order over the
    slots (some free, some done prefilling), mid-block starts, budgets below, at and above C."""
    rng = np.random.default_rng(3)
    for _ in range(500):
        slots, chunk = int(rng.integers(1, 7)), int(rng.choice([1, 4, 8]))
        admitted = rng.permutation(slots)  # admitted[slot]: its rank
        rows, held = [], []
        for slot in range(slots):
            size = int(rng.integers(1, 40))
            start = int(rng.integers(0, size + 1))
            if rng.random() < 0.2:
                rows.append(None)
                continue
            rows.append(types.SimpleNamespace(id=int(admitted[slot]), prefilled=start, prompt=np.zeros(size)))
            if start < size:
                held.append((int(admitted[slot]), start, size))
        budget = int(rng.integers(1, 3 * chunk * slots + 2))
        engine = types.SimpleNamespace(_rows=rows, prefill_budget=budget, chunk=chunk)
        shares = Engine._prefill_shares(engine)
        assert {rows[slot].id: n for slot, n in shares.items()} == reference_shares(held, budget, chunk), (rows, budget)


@pytest.mark.parametrize("budget, cache", [(5, 0), (12, 0), (12, 1 << 20)])  # below C, above C with a remainder, with hits
def test_prefill_shares_go_by_admission_not_slot_and_end_on_block_boundaries(model, budget, cache):
    rng = np.random.default_rng(11)
    draw = lambda n: rng.integers(3, model.config.vocab_size, n).tolist()  # noqa: E731
    b = draw(30)
    # a (slot 0) and c (slot 2) end at their first token; d then e take their slots while b (slot 1) is
    # still prefilling: later-admitted requests in lower slots than b; e shares b's first 2 blocks
    requests = [(draw(3), SamplingParams(max_tokens=1)), (b, greedy()), (draw(20), SamplingParams(max_tokens=1)),
                (draw(20), greedy()), (b[:17] + draw(6), greedy())]
    engine = Engine(model, slots=SLOTS, cache_size=CACHE, chunk=CHUNK, prefill_budget=budget,
                    prefix_cache_bytes=cache)
    queues = [queue.Queue() for _ in requests]
    ranks = {engine.submit(p, params, events=q): rank for rank, ((p, params), q) in enumerate(zip(requests, queues))}
    calls = recorded_prefill(engine, ranks)
    while engine.has_work():
        engine.step()
    progress, slot_order_differs = {}, False
    for prefilling, given in calls:
        held = [(rank, start, size) for rank, start, size, _ in prefilling]
        assert given == reference_shares(held, budget), (prefilling, given)
        for rank, start, size in held:
            # what a request holds is what its earlier shares gave it, after a hit of whole blocks
            assert start == progress.get(rank, start) and (rank in progress or start % CHUNK == 0)
            if rank in given:  # a share ends on a block boundary or the prompt's end, or spends the budget
                end = start + given[rank]
                spent = rank == max(given) and sum(given.values()) == budget
                assert end % CHUNK == 0 or end == size or spent, (rank, start, given[rank], size)
            progress[rank] = start + given.get(rank, 0)
        by_slot = sorted(prefilling, key=lambda p: p[3])
        slot_order_differs |= [p[0] for p in by_slot] != sorted(p[0] for p in by_slot) and (
            by_slot[0][0] not in given)  # a later-admitted request in a lower slot waits its turn
    assert slot_order_differs and len(calls) > 4
    assert (engine.stats()["prefix_hits"] > 0) == bool(cache)
    for (prompt, params), q in zip(requests, queues):
        finished, _ = drain(q)
        alone = generate(model, [prompt], params.max_tokens)[0].tolist()
        assert finished.tokens == alone[:len(finished.tokens)]


def test_a_prefix_entry_holds_a_blocks_keys_the_ring_and_the_carry(model):
    # fp32: keys+values of 1 full layer x 8 positions, 1 ring of 6, and 2 layers' carry (6+6+1 heads of 8)
    assert entry_bytes(model.config, CHUNK, CACHE) == 4 * (2 * 8 * 2 * 8 + 2 * 6 * 2 * 8 + 2 * 13 * 8) == 2624
    zaya1 = model_config(load_config_file("configs/zaya1_base.py"))  # bf16, 40 full layers, K=2, H=128, 10+10+1 heads
    assert entry_bytes(zaya1, 16, 4096) == 2 * (40 * 16 * 2 * 2 * 128 + 40 * 21 * 128)  # 40 KiB a token + 210 KiB

def test_cancel_frees_the_slot_at_once_and_nothing_leaks(model, prompts):
    # decode_block=1: one token per step, so the second request is still running after 3 steps
    engine = Engine(model, slots=2, cache_size=CACHE, chunk=CHUNK, prefix_cache_bytes=6000, decode_block=1)
    long = SamplingParams(max_tokens=20, ignore_eos=True)
    queues = [queue.Queue() for _ in range(4)]
    first, second, third, fourth = (engine.submit(p, params, events=q) for (p, params), q in
                                    zip([(prompts[2], long), (prompts[1], greedy()), (prompts[5], greedy()),
                                         (prompts[3], long)], queues))
    for _ in range(3):  # the first (20 tokens) prefilled in 3 chunks, and decoding
        engine.step()
    assert engine.stats()["running"] == 2 and engine.stats()["waiting"] == 2
    assert engine.cancel(first) and engine.cancel(fourth) and not engine.cancel(first)
    assert engine.stats()["free_slots"] == 1 and engine.stats()["waiting"] == 1
    while engine.has_work():
        engine.step()
    results = {i: drain(q)[0] for i, q in zip((first, second, third, fourth), queues)}
    assert results[first].reason == results[fourth].reason == "cancelled" and results[fourth].tokens == []
    assert 0 < len(results[first].tokens) < 20
    # the third request took the cancelled one's slot mid-flight, and is what it is alone
    for i, prompt in ((second, prompts[1]), (third, prompts[5])):
        alone = generate(model, [prompt], MAX_TOKENS)[0].tolist()
        assert results[i].tokens == alone[:len(results[i].tokens)]
    stats = engine.stats()
    assert (stats["running"], stats["waiting"], stats["free_slots"]) == (0, 0, 2)
    assert stats["prefix_bytes"] == stats["prefix_entries"] * entry_bytes(model.config, CHUNK, CACHE) <= 6000


def test_background_loop_streams_to_the_callback_and_the_queue(model, prompts):
    engine = Engine(model, slots=SLOTS, cache_size=CACHE, chunk=CHUNK)
    seen = []
    engine.start()
    try:
        engine.submit(prompts[1], greedy(), events=(events := queue.Queue()), on_token=lambda i, e: seen.append(e.token))
        tokens = []
        while not isinstance(event := events.get(timeout=60), Finished):
            tokens.append(event.token)
    finally:
        engine.stop()
    assert tokens == seen == event.tokens and len(tokens) >= 1


def test_nothing_compiles_after_warm_up(model, prompts, shared):
    engine = Engine(model, slots=SLOTS, cache_size=CACHE, chunk=CHUNK, prefix_cache_bytes=1 << 20)
    engine.warm_up()
    assert engine.restore_buckets == (1, 2, 4, 5)  # a hit holds at most (48 - 1) // 8 blocks
    run(engine, [[(shared[0], greedy())]])  # stores base[:26]'s 3 blocks
    with compilations() as compiled:
        # prefix hits of 3 blocks (shared[2], restored as 4), 2 (shared[1]) and 3 (shared[5])
        queues = [submit(engine, p, params) for p, params in
                  [(shared[2], sampled(3)), (prompts[2], sampled(4)), (shared[1], greedy()),
                   (prompts[0], SamplingParams(max_tokens=3)),
                   (shared[5], SamplingParams(max_tokens=5, temperature=0.5, top_p=0.5, logprobs=True)),
                   (prompts[4], greedy())]]
        engine.step()
        engine.cancel(engine.submit(prompts[3], greedy()))
        while engine.has_work():
            engine.step()
        queues.append(submit(engine, shared[4], greedy()))  # base[:9]: a hit of 1 block
        while engine.has_work():
            engine.step()
    assert compiled == []
    assert all(drain(q)[0].reason in ("stop", "length") for q in queues)
    restores = {b: n for (kind, b), n in engine.calls.items() if kind == "restore"}
    assert restores == {4: 2, 2: 1, 1: 1} and engine.stats()["prefix_hits"] == 4  # one call a hit


def test_warm_up_compiles_every_row_bucket(model, prompts):
    engine = Engine(model, slots=SLOTS, cache_size=CACHE, chunk=CHUNK)
    engine.warm_up()
    with compilations() as compiled:
        # prompts arriving one, then two, then three at a time: chunk calls of 1, 2 and 3 rows
        done = run(engine, [[(prompts[0], greedy())]])
        done += run(engine, [[(p, greedy()) for p in prompts[1:3]]])
        done += run(engine, [[(p, greedy()) for p in prompts[3:6]]])
    assert compiled == [] and {rows for kind, rows in engine.calls if kind == "chunk"} == {1, 2, 3}
    assert engine.row_buckets == (1, 2, 3) and all(f.reason in ("stop", "length") for f, _ in done)


BAD = {
    "temperature": (dict(temperature=-0.5), "temperature must be >= 0, got -0.5"),
    "top_p": (dict(top_p=1.5), r"top_p must lie in \(0, 1\], got 1.5"),
    "top_p zero": (dict(top_p=0.0), r"top_p must lie in \(0, 1\], got 0.0"),
    "top_k": (dict(top_k=0), r"top_k must be an integer in \[1, vocab_size=64\]"),
    "max_tokens": (dict(max_tokens=0), "max_tokens must be a positive integer"),
    "top_logprobs": (dict(top_logprobs=6), r"top_logprobs must be an integer in \[0, 5\]"),
    "stop_ids": (dict(stop_ids=[64]), "outside the vocabulary"),
    "seed": (dict(seed=-1), r"seed must be an integer in \[0, 2\*\*32\)"),
    "too long": (dict(max_tokens=40), "prompt of 11 tokens \\+ max_tokens 40 needs 50 positions, 2 more than "
                                      "cache_size=48: shorten the prompt or lower max_tokens by 2"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_params_fail_clearly_before_anything_runs(model, prompts, case):
    engine = Engine(model, slots=SLOTS, cache_size=CACHE, chunk=CHUNK)
    kwargs, message = BAD[case]
    with pytest.raises(ValueError, match=message):
        engine.submit(prompts[1], SamplingParams(**kwargs))
    assert not engine.has_work() and engine.stats()["waiting"] == 0


def test_a_callback_may_cancel_its_own_or_another_request_mid_step(model, prompts):
    engine = Engine(model, slots=SLOTS, cache_size=CACHE, chunk=CHUNK)
    long = SamplingParams(max_tokens=20, ignore_eos=True)
    ids = {}

    def cancel_after_two(request, event):
        if len(seen.setdefault(request, [])) == 1:
            engine.cancel(ids["other"] if request == ids["first"] else request)
        seen[request].append(event.token)
    seen = {}
    queues = [queue.Queue() for _ in range(3)]
    ids["first"] = engine.submit(prompts[0], long, events=queues[0], on_token=cancel_after_two)  # cancels "other"
    ids["other"] = engine.submit(prompts[3], long, events=queues[1])
    ids["self"] = engine.submit(prompts[1], long._replace(stop=lambda t: len(t) == 2), events=queues[2],
                                on_token=cancel_after_two)  # cancels itself, as its stop rule would too
    while engine.has_work():
        engine.step()
    first, other, itself = (drain(q)[0] for q in queues)
    assert first.reason == "length" and len(first.tokens) == 20
    assert other.reason == itself.reason == "cancelled" and len(itself.tokens) == 2 and len(other.tokens) < 20
