"""Chunked prefill that continues a decode state (zaya_jax.infer.decode.extend) == the full forward:
chunks of any size from 1 to C, across the sliding window and wrapping its ring several times, rows
that skip a chunk unchanged, and a chunk of one token == decode_step."""

import jax
import numpy as np
import pytest


from tests.model_fixtures import random_tiny_model
from zaya_jax.infer.decode import Rows, decode_step, extend, extend_rows, prefill
from zaya_jax.engine import generate

WINDOW = 6
MIXED = dict(layer_types=("hybrid_sliding", "hybrid"), sliding_window=WINDOW, sliding_rope_theta=500.0)
CHUNK, CACHE = 8, 48
SEQ = 36
GREEDY = 6
# per row: the prefilled first part, then the chunk sizes (0: the row sits that call out)
FIRST = [2, 5]
CHUNKS = [[1, 8, 3, 0, 7, 8, 1, 5], [8, 8, 0, 1, 7, 6, 1, 0]]

extend_jit = jax.jit(extend)


@pytest.fixture(scope="module", params=[True, False], ids=["scan", "loop"])
def model(request):
    return random_tiny_model(**MIXED, scan_layers=request.param)


@pytest.fixture(scope="module")
def sequences(model):
    return np.random.default_rng(3).integers(3, model.config.vocab_size, (2, SEQ)).astype(np.int32)


@pytest.fixture(scope="module")
def full_logits(model, sequences):
    return np.asarray(jax.jit(lambda m, x: m(x))(model, sequences))


def _prefill(model, sequences, lengths):
    ids = np.where(np.arange(16)[None] < np.asarray(lengths)[:, None], sequences[:, :16], 0)
    return jax.jit(prefill, static_argnums=3)(model, ids, np.asarray(lengths, np.int32), CACHE)


def test_chunks_of_every_size_across_the_window_match_the_full_forward(model, sequences, full_logits):
    logits, state = _prefill(model, sequences, FIRST)
    at, last = np.array(FIRST), np.array(logits)
    for step in range(len(CHUNKS[0])):
        counts = np.array([row[step] for row in CHUNKS], np.int32)
        ids = np.zeros((2, CHUNK), np.int32)
        for b, n in enumerate(counts):
            ids[b, :n] = sequences[b, at[b]:at[b] + n]
        before = state
        logits, state = extend_jit(model, state, ids, counts)
        for b, n in enumerate(counts):
            if n:
                last[b] = np.asarray(logits[b])
                np.testing.assert_allclose(np.asarray(logits[b]), full_logits[b, at[b] + n - 1], atol=1e-5, rtol=0,
                                           err_msg=f"row {b} after position {at[b] + n - 1}")
            else:  # a row with no tokens is left exactly as it was
                for old, new in zip(jax.tree.leaves(before), jax.tree.leaves(state)):
                    np.testing.assert_array_equal(np.asarray(old)[:, b] if old.ndim > 1 else np.asarray(old)[b],
                                                  np.asarray(new)[:, b] if new.ndim > 1 else np.asarray(new)[b])
        at += counts
    assert at.tolist() == [SEQ - 1, SEQ] and (at > 4 * WINDOW).all()  # the ring wrapped several times
    np.testing.assert_array_equal(np.asarray(state.lengths), at)
    # greedy decoding on from the extended state == zaya_jax.generate after a plain prefill of each prefix
    step, tokens = jax.jit(decode_step), [last.argmax(-1).astype(np.int32)]
    for _ in range(GREEDY - 1):
        logits, state = step(model, state, tokens[-1])
        tokens.append(np.asarray(jax.numpy.argmax(logits, -1)))
    for b in range(2):
        expected = generate(model, [sequences[b, :at[b]].tolist()], GREEDY, stop_at_eos=False)[0]
        np.testing.assert_array_equal(np.stack(tokens, 1)[b], expected, err_msg=f"row {b}")


def test_a_chunk_of_one_token_is_a_decode_step(model, sequences):
    _, state = _prefill(model, sequences, FIRST)
    ids = np.zeros((2, CHUNK), np.int32)
    ids[:, 0] = sequences[:, 5]
    chunked = extend_jit(model, state, ids, np.ones(2, np.int32))
    stepped = jax.jit(decode_step)(model, state, ids[:, 0])
    for a, b in zip(jax.tree.leaves(chunked), jax.tree.leaves(stepped)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)


# extend_rows: per step, the all-rows group's counts (<= 1, decode-like) and the gathered group's (slots, counts)
GROUP_STEPS = [([1, 0, 1], [1], [8]), ([0, 1, 0], [0, 2], [7, 8]), ([1, 1, 1], [2], [0]), ([0, 0, 0], [1, 0], [6, 3]),
               ([1, 1, 1], [0], [0])]


def test_rows_in_two_groups_match_the_full_forward(model):
    """The engine's prefill-with-decode call: one group of every row taking 0 or 1 token, one of
    gathered rows (in any order, some sitting out) taking a chunk, in one extend_rows call; each
    row's logits match the full forward, across the window, scanned and looped."""
    sequences = np.random.default_rng(4).integers(3, model.config.vocab_size, (3, SEQ)).astype(np.int32)
    full = np.asarray(jax.jit(lambda m, x: m(x))(model, sequences))
    at = np.array([2, 5, 3])
    ids = np.where(np.arange(16)[None] < at[:, None], sequences[:, :16], 0)
    _, state = jax.jit(prefill, static_argnums=3)(model, ids, at.astype(np.int32), CACHE)
    call = jax.jit(extend_rows)
    for step, (one, slots, chunk) in enumerate(GROUP_STEPS):
        decode_ids = np.array([[sequences[b, at[b]]] for b in range(3)], np.int32)
        chunk_ids = np.zeros((len(slots), CHUNK), np.int32)
        for i, (b, n) in enumerate(zip(slots, chunk)):
            chunk_ids[i, :n] = sequences[b, at[b]:at[b] + n]
        (decode_logits, chunk_logits), state = call(model, state, [
            Rows(None, decode_ids, np.array(one, np.int32)),
            Rows(np.array(slots, np.int32), chunk_ids, np.array(chunk, np.int32))])
        took = np.array(one)
        for b in range(3):
            if one[b]:
                np.testing.assert_allclose(np.asarray(decode_logits[b]), full[b, at[b]], atol=1e-5, rtol=0,
                                           err_msg=f"step {step}: row {b} decoding")
        for i, (b, n) in enumerate(zip(slots, chunk)):
            took[b] += n
            if n:
                np.testing.assert_allclose(np.asarray(chunk_logits[i]), full[b, at[b] + n - 1], atol=1e-5, rtol=0,
                                           err_msg=f"step {step}: row {b} in the chunk")
        at += took
        np.testing.assert_array_equal(np.asarray(state.lengths), at)
    assert (at > 2 * WINDOW).all()  # every row's ring wrapped


def test_padding_reaches_no_expert(model, sequences, monkeypatch):
    """prefill's padding past each length and extend's past each count (a short last chunk, a row
    sitting the call out) go to the skip slot: the dispatch is handed choice E there, so a dropless
    backend computes only the real tokens (benchmarks/serving/serve_load.py's step split times it)."""
    import zaya_jax.model.moe as moe_module
    seen = []
    real_dispatch = moe_module.dispatch_on_mesh

    def spy(dispatch, x, choice, weights, **options):
        seen.append(choice)
        return real_dispatch(dispatch, x, choice, weights, **options)
    monkeypatch.setattr(moe_module, "dispatch_on_mesh", spy)
    experts = model.config.num_experts
    with jax.disable_jit():
        _, state = _prefill(model, sequences, FIRST)
        prefill_choices = [np.asarray(c) for c in seen]
        seen.clear()
        ids = np.zeros((2, CHUNK), np.int32)
        ids[0, :3] = sequences[0, FIRST[0]:FIRST[0] + 3]
        extend(model, state, ids, np.array([3, 0], np.int32))
    assert len(prefill_choices) == len(seen) == model.config.num_layers  # every layer's MoE, both calls
    for choice in prefill_choices:  # [2,16]: row b's positions from FIRST[b] on are padding
        for b, length in enumerate(FIRST):
            assert (choice[b, length:] == experts).all() and (choice[b, :length] <= experts).all()
    for choice in map(np.asarray, seen):
        assert (choice[0, 3:] == experts).all() and (choice[1] == experts).all()
        assert (choice[0, :3] < experts).any()  # the real tokens are routed (the skip slot is rare)
