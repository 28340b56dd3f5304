"""The serving engine with a ZAYA1-VL model (zaya_jax.engine.images): requests with images of
different sizes, prefilled whole and alone, sharing the slots with text requests that arrive at
other steps, each equal to `zaya_jax.generate` of it alone (tokens exactly, logprobs the whole
model's); images bypass the prefix cache; warm-up for an image size leaves nothing to compile for it;
bad image requests are refused before anything runs."""

import dataclasses
import queue

import jax
import numpy as np
import pytest
from flax import nnx

from tests.test_engine_serving import compilations, drain, submit
from tests.test_vision_generate import PROCESSOR, WIDTH, whole_model_logits
from tests.vision_fixtures import IDS, TEXT, random_vl_model
from zaya_jax.data.vision.prompts import expand_placeholders
from zaya_jax.engine import Engine, SamplingParams
from zaya_jax.engine import generate

SLOTS, CACHE, CHUNK, NEW = 3, 40, 8, 6


@pytest.fixture(scope="module")
def model():
    return random_vl_model(dataclasses.replace(TEXT, layer_types=("hybrid_sliding", "hybrid"), sliding_window=4))


@pytest.fixture(scope="module")
def requests():
    """(prompt, images) pairs: two images (16x24 and 8x16: 6 and 2 tokens), text, one 16x16 image, text,
    the 16x16 one's prompt with another image of that size (same ids, other pixels), and the first
    text prompt's first block (CHUNK tokens) before an 8x16 image."""
    rng = np.random.default_rng(7)
    pictures = [rng.integers(0, 256, shape, np.uint8) for shape in [(16, 24, 3), (8, 16, 3), (16, 16, 3), (16, 16)]]

    def with_images(short, images):
        return expand_placeholders(short, [PROCESSOR(p)[1] for p in images], IDS), images
    one = [2, 9, IDS.vision_start, IDS.image, IDS.vision_end, 7]
    text = rng.integers(3, 89, 11).tolist()
    return [with_images([2, 17, 5, IDS.image, 33, IDS.image, 40, 41], pictures[:2]),
            (text, []), with_images(one, pictures[2:3]),
            (rng.integers(3, 89, 19).tolist(), []), with_images(one, pictures[3:4]),
            with_images(text[:CHUNK] + [IDS.image, 7], pictures[1:2])]


def text_logits(model, prompt: list[int]) -> np.ndarray:
    """The text model's logits at the prompt's last token [V] (right-padded to WIDTH: causal, so exact)."""
    ids = np.zeros((1, WIDTH), np.int32)
    ids[0, :len(prompt)] = prompt
    return np.asarray(_text_forward(model.text, ids)[0, len(prompt) - 1])


_text_forward = nnx.jit(lambda model, ids: model(ids))


def greedy() -> SamplingParams:
    return SamplingParams(max_tokens=NEW, logprobs=True, top_logprobs=2)


def serve_arrivals(engine: Engine, requests) -> list[queue.Queue]:
    """requests submitted greedy, two at steps 0 and 1 and two at step 3, served to the end -> each one's events."""
    queues = []
    for batch in [requests[:2], requests[2:4], [], requests[4:]]:
        for prompt, images in batch:
            engine.submit(prompt, greedy(), images=images, events=(events := queue.Queue()))
            queues.append(events)
        engine.step()
    while engine.has_work():
        engine.step()
    return queues


def test_image_and_text_requests_together_equal_each_alone(model, requests):
    """Arrivals at steps 0, 0, 1, 1, 3 and 3 into 3 slots (the prefix cache on): the image requests are
    prefilled whole beside text requests mid-prefill or decoding; each response is generate's for it
    alone, its logprobs the whole model's over prompt + tokens. Two share their ids and differ in
    their image's pixels: different answers; the last one starts with a block the cache holds, yet
    no prefix hit (images bypass the cache)."""
    engine = Engine(model, slots=SLOTS, cache_size=CACHE, chunk=CHUNK, prefix_cache_bytes=1 << 20,
                    image_processor=PROCESSOR)
    queues = serve_arrivals(engine, requests)
    answers = []
    for (prompt, images), q in zip(requests, queues):
        finished, events = drain(q)
        alone = generate(model, [prompt], NEW, images=[images] if images else None,
                                  image_processor=PROCESSOR)[0].tolist()
        n = len(finished.tokens)
        assert finished.tokens == alone[:n] and (n == NEW or finished.tokens[-1] == TEXT.eos_token_id)
        sequence, want = list(prompt), []
        for token in finished.tokens:
            want.append(jax.nn.log_softmax(whole_model_logits(model, sequence, images) if images
                                           else text_logits(model, sequence))[token])
            sequence.append(token)
        np.testing.assert_allclose(finished.logprobs, want, atol=1e-4, rtol=0)
        assert [e.token for e in events] == finished.tokens
        answers.append(finished.tokens)
    assert answers[2] != answers[4]
    stats = engine.stats()
    assert stats["prefix_hits"] == 0 and stats["prompt_tokens"] == sum(len(p) for p, _ in requests)
    assert stats["running"] == stats["waiting"] == 0


def test_a_seeded_sampled_image_request_is_the_same_alone_and_among_others(model, requests):
    """Its first token is drawn in the image prefill with its own seed and index, the rest in the
    shared decode steps: the same tokens alone as beside a text request and a one-token image request."""
    engine = Engine(model, slots=3, cache_size=CACHE, chunk=CHUNK, image_processor=PROCESSOR)
    sampled = SamplingParams(max_tokens=NEW, temperature=1.5, seed=5, ignore_eos=True)
    prompt, images = requests[0]
    engine.submit(prompt, sampled, images=images, events=(alone := queue.Queue()))
    while engine.has_work():
        engine.step()
    others = [submit(engine, requests[3][0], greedy())]
    engine.step()
    engine.submit(requests[2][0], SamplingParams(max_tokens=1), images=requests[2][1], events=(one := queue.Queue()))
    engine.submit(prompt, sampled, images=images, events=(among := queue.Queue()))
    while engine.has_work():
        engine.step()
    want = drain(alone)[0].tokens
    assert drain(among)[0].tokens == want and len(want) == NEW
    assert len(drain(one)[0].tokens) == 1 and drain(others[0])[0].reason in ("stop", "length")


def test_warm_up_for_an_image_size_leaves_nothing_to_compile(model, requests):
    engine = Engine(model, slots=2, cache_size=CACHE, chunk=CHUNK, image_processor=PROCESSOR)
    engine.warm_up(image_sizes=((16, 16),))
    with compilations() as compiled:
        queues = [submit(engine, requests[1][0], greedy())]
        engine.step()
        engine.submit(requests[2][0], SamplingParams(max_tokens=3), images=requests[2][1],
                      events=(events := queue.Queue()))
        queues.append(events)
        while engine.has_work():
            engine.step()
    assert compiled == [] and all(drain(q)[0].reason in ("stop", "length") for q in queues)


def test_bad_image_requests_are_refused_before_anything_runs(model, requests):
    engine = Engine(model, slots=1, cache_size=CACHE, chunk=CHUNK, image_processor=PROCESSOR)
    prompt, images = requests[0]
    with pytest.raises(ValueError, match="example 0: 8 image placeholders .* for 2 image tokens"):
        engine.submit(prompt, greedy(), images=images[1:])
    with pytest.raises(ValueError, match="hold image placeholders .* but no images"):
        engine.submit(prompt, greedy())
    text = Engine(model.text, slots=1, cache_size=CACHE, chunk=CHUNK)
    with pytest.raises(ValueError, match="images need a vision-language model"):
        text.submit([2, 5], greedy(), images=images[:1])
    with pytest.raises(ValueError, match="needs a vision-language model"):
        text.warm_up(image_sizes=((16, 16),))
    assert not engine.has_work() and not text.has_work()
    submit(engine, [2, 5], SamplingParams(max_tokens=1))  # a text request on a vision-language engine
    while engine.has_work():
        engine.step()


def test_a_vl_engine_on_a_mesh_serves_what_one_device_serves(model, requests):
    """data=2,tensor=2,expert=2 on 8 fake devices: the tower's weights split by the trainer's rules
    and each image prefill's row repeated over the 4 rows the MoE splits (data x expert). The image
    and text requests arriving as in the test above give the one-device engine's tokens, logprobs
    within 1e-4 (fp32; sharded sums add in another order)."""
    from zaya_jax.parallel.mesh import make_mesh, parse_mesh_flag

    def serve(engine):
        return [drain(q)[0] for q in serve_arrivals(engine, requests)]
    settings = dict(slots=4, cache_size=CACHE, chunk=CHUNK, image_processor=PROCESSOR)
    want = serve(Engine(model, **settings))
    sharded = Engine(model, **settings, mesh=make_mesh(parse_mesh_flag("data=2,tensor=2,expert=2")))
    got = serve(sharded)
    for a, b in zip(got, want):
        assert a.tokens == b.tokens and a.reason == b.reason
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4, rtol=0)
    tower = [x for x in jax.tree.leaves(sharded._vision[1]) if len(x.sharding.device_set) == 8]
    assert tower and any(not x.sharding.is_fully_replicated for x in tower)
    assert sharded.calls and sharded.row_buckets[0] == 4
