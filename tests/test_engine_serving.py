"""The serving engine (zaya_jax.engine): continuous batching, per-request sampling, exact prefix
caching, cancellation, bounded compilation and argument checks, on a tiny mixed sliding/full model."""

import jax
import numpy as np
import pytest

import zaya_jax
from tests.model_fixtures import tiny_model
from zaya_jax.engine import Engine, Finished, SamplingParams

WINDOW = 6
MIXED = dict(layer_types=("hybrid_sliding", "hybrid"), sliding_window=WINDOW, sliding_rope_theta=500.0)
SLOTS, CACHE, CHUNK = 3, 48, 8
MAX_TOKENS = 8
LENGTHS = [3, 11, 20, 5, 9, 17]  # some past C, several past the window


@pytest.fixture(scope="module")
def model():
    return tiny_model(**MIXED)


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
        queues += [engine.events(engine.submit(p, params)) for p, params in batch]
        engine.step()
    while engine.has_work():
        engine.step()
    return [drain(q) for q in queues]


def drain(events) -> tuple[Finished, list]:
    tokens = []
    while not isinstance(event := events.get_nowait(), Finished):
        tokens.append(event)
    return event, tokens


def greedy(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, logprobs=True, top_logprobs=3, **kw)


def test_mixed_load_equals_each_request_alone(model, prompts, forward):
    engine = Engine(model, slots=SLOTS, cache_size=CACHE, chunk=CHUNK)
    batches = [[(p, greedy()) for p in prompts[:4]], [], [(prompts[4], greedy())], [(prompts[5], greedy())]]
    done = run(engine, batches)
    for prompt, (finished, events) in zip(prompts, done):
        alone = zaya_jax.generate(model, [prompt], MAX_TOKENS)[0].tolist()
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
