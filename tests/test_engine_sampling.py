"""Per-row sampling settings as arrays (zaya_jax.infer.sampling.filter_rows, zaya_jax.engine.step.pick)
against a numpy reference of the rule, row by row, in one batch."""

import jax
import numpy as np

from zaya_jax.engine.step import RowSampling, pick
from zaya_jax.infer.sampling import filter_rows

V = 12
# temperature, top_k (V: off), top_p (1: off)
ROWS = [(1.0, V, 1.0), (0.7, 3, 1.0), (1.3, V, 0.6), (0.5, 4, 0.8), (2.0, 1, 1.0), (1.0, V, 0.05)]


def reference(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """The documented rule on one row: temper, keep the top_k largest, then the smallest set of
    largest-probability tokens whose mass reaches top_p."""
    z = logits / temperature
    z = np.where(z < np.sort(z)[::-1][top_k - 1], -np.inf, z)
    if top_p < 1:
        ordered = np.sort(z)[::-1]
        probs = np.exp(ordered - ordered.max())
        probs /= probs.sum()
        kept = ordered[np.cumsum(probs) - probs < top_p]
        z = np.where(z < kept.min(), -np.inf, z)
    return z


def test_each_row_filters_with_its_own_settings():
    logits = np.random.default_rng(0).normal(size=(len(ROWS), V)).astype(np.float32) * 2
    t, k, p = (np.array(c) for c in zip(*ROWS))
    ours = np.asarray(jax.jit(filter_rows)(logits, t.astype(np.float32), k.astype(np.int32), p.astype(np.float32)))
    for b, row in enumerate(ROWS):
        expected = reference(logits[b].astype(np.float64), *row)
        np.testing.assert_array_equal(np.isfinite(ours[b]), np.isfinite(expected), err_msg=f"row {b} {row}")
        np.testing.assert_allclose(ours[b][np.isfinite(ours[b])], expected[np.isfinite(expected)], rtol=1e-6)
    kept = np.isfinite(ours).sum(-1)
    assert kept[1] == 3 and kept[4] == 1 and kept[5] == 1 and kept[0] == V


def test_pick_draws_within_each_rows_filter_and_reports_untempered_logprobs():
    logits = np.random.default_rng(1).normal(size=(len(ROWS), V)).astype(np.float32) * 2
    t, k, p = (np.array(c) for c in zip(*ROWS))
    temperature = np.where(np.arange(len(ROWS)) == 0, 0.0, t)  # row 0 greedy.astype(np.float32)
    logp = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    for index in range(20):
        rows = RowSampling(temperature, k.astype(np.int32), p.astype(np.float32), np.arange(len(ROWS), dtype=np.uint32),
                           np.full(len(ROWS), index, np.int32), np.full(len(ROWS), 3, np.int32))
        picked = jax.jit(pick, static_argnums=2)(logits, rows, 3)
        token = np.asarray(picked.token)
        assert token[0] == logits[0].argmax() and token[4] == logits[4].argmax() and token[5] == logits[5].argmax()
        for b, row in enumerate(ROWS):
            assert np.isfinite(reference(logits[b].astype(np.float64), *row)[token[b]]), f"row {b} drew a filtered token"
        np.testing.assert_allclose(np.asarray(picked.logprob), logp[np.arange(len(ROWS)), token], rtol=1e-6)
        np.testing.assert_array_equal(np.asarray(picked.top_tokens), np.argsort(-logp, axis=-1)[:, :3])


def primitives(jaxpr, into_cond: bool) -> set[str]:
    """The primitive names a jaxpr runs, looking into nested jitted calls, and into lax.cond's
    branches only if into_cond."""
    names = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        if eqn.primitive.name == "cond" and not into_cond:
            continue
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else [value]:
                sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's jaxpr
                if hasattr(sub, "eqns"):
                    names |= primitives(sub, into_cond)
    return names


def test_pick_draws_and_ranks_only_when_a_row_asks():
    logits = np.random.default_rng(2).normal(size=(len(ROWS), V)).astype(np.float32)
    zeros = np.zeros(len(ROWS), np.int32)
    greedy = RowSampling(np.zeros(len(ROWS), np.float32), np.full(len(ROWS), V, np.int32),
                         np.ones(len(ROWS), np.float32), zeros.astype(np.uint32), zeros, zeros)
    program = jax.make_jaxpr(pick, static_argnums=2)(logits, greedy, 3).jaxpr
    # the filter's sort, the draw and the best-K search sit in lax.cond branches, not on the straight path
    assert {"sort", "top_k", "random_bits"} <= primitives(program, into_cond=True)
    assert not {"sort", "top_k", "random_bits"} & primitives(program, into_cond=False)
    picked = jax.jit(pick, static_argnums=2)(logits, greedy, 3)
    np.testing.assert_array_equal(np.asarray(picked.token), logits.argmax(-1))
    assert not np.asarray(picked.top_tokens).any() and not np.asarray(picked.top_logprobs).any()  # none asked
    one_asks = jax.jit(pick, static_argnums=2)(logits, greedy._replace(top_logprobs=np.eye(len(ROWS), dtype=np.int32)[0]), 3)
    np.testing.assert_array_equal(np.asarray(one_asks.top_tokens), np.argsort(-logits, axis=-1)[:, :3])
