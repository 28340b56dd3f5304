"""generate(): greedy parity with transformers' generate, ragged batches, sampling, eos, inputs."""

import jax.numpy as jnp
import numpy as np
import pytest

from tests.hf_reference import jax_from_hf, make_hf_model
from zaya_jax.infer.static_loop import pad_prompts
from zaya_jax.infer.sampling import Sampler, filter_logits
from zaya_jax.engine import generate

NEW = 8
PROMPTS = [[5, 6, 7, 8, 9], [40, 3, 77], [11, 12, 13, 14, 15, 16, 17]]


@pytest.fixture(scope="module")
def hf_model():
    return make_hf_model(seed=0)


@pytest.fixture(scope="module")
def model(hf_model):
    return jax_from_hf(hf_model)


@pytest.mark.torch_reference
def test_greedy_matches_transformers_generate(hf_model, model):
    import torch

    prompts = np.random.default_rng(3).integers(3, hf_model.config.vocab_size, (3, 6))
    with torch.no_grad():
        hf_out = hf_model.generate(torch.as_tensor(prompts), attention_mask=torch.ones(prompts.shape, dtype=torch.long),
                                   max_new_tokens=NEW, do_sample=False).numpy()[:, prompts.shape[1]:]
    ours = generate(model, prompts, NEW)
    assert ours.shape == (3, NEW)
    # transformers stops once every row has emitted eos; we return max_new_tokens columns, padded.
    np.testing.assert_array_equal(ours[:, :hf_out.shape[1]], hf_out)


@pytest.mark.torch_reference
def test_prompts_of_different_lengths_generate_as_they_do_alone(model):
    together = generate(model, PROMPTS, NEW)
    for row, prompt in zip(together, PROMPTS, strict=True):
        np.testing.assert_array_equal(row, generate(model, [prompt], NEW)[0])


def test_padded_array_with_lengths_equals_list_of_lists():
    ids, lengths = pad_prompts(PROMPTS, None, pad_id=0, vocab_size=97)
    assert ids.shape == (3, 16) and lengths.tolist() == [5, 3, 7]
    again, again_lengths = pad_prompts(ids[:, :7], lengths, pad_id=0, vocab_size=97)
    np.testing.assert_array_equal(again, ids)
    np.testing.assert_array_equal(again_lengths, lengths)
    one, _ = pad_prompts([5, 6, 7], None, pad_id=0, vocab_size=97)  # a flat list is one prompt
    assert one.shape == (1, 16)


@pytest.mark.torch_reference
def test_sampling_is_seeded_and_top_k_1_is_greedy(model):
    sample = lambda **kw: generate(model, PROMPTS, NEW, temperature=1.5, **kw)  # noqa: E731
    np.testing.assert_array_equal(sample(seed=1), sample(seed=1))
    assert not np.array_equal(sample(seed=1), sample(seed=2))
    np.testing.assert_array_equal(sample(seed=4, top_k=1), generate(model, PROMPTS, NEW))


def test_top_k_and_top_p_keep_the_right_tokens():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
    kept = lambda **kw: np.isfinite(np.asarray(filter_logits(logits, Sampler(1.0, **kw))))[0].tolist()  # noqa: E731
    assert kept(top_k=2) == [True, True, False, False]
    assert kept(top_p=0.5) == [True, False, False, False]
    assert kept(top_p=0.7) == [True, True, False, False]
    assert kept(top_p=0.81) == [True, True, True, False]
    assert kept(top_k=3, top_p=1.0) == [True, True, True, False]


@pytest.mark.torch_reference
def test_eos_stops_a_sequence_and_pads_the_rest(hf_model, model):
    eos = int(generate(model, PROMPTS, NEW)[0, 0])
    stopping = jax_from_hf(hf_model, eos_token_id=eos)
    out = generate(stopping, PROMPTS, NEW)
    np.testing.assert_array_equal(out[0], [eos] + [stopping.config.pad_token_id] * (NEW - 1))
    for row in out[1:]:  # the others stop right after their first eos, if any
        hit = np.flatnonzero(row == eos)
        if hit.size:
            assert (row[hit[0] + 1:] == stopping.config.pad_token_id).all()
    free = generate(stopping, PROMPTS, NEW, stop_at_eos=False)
    np.testing.assert_array_equal(free, generate(model, PROMPTS, NEW))


@pytest.mark.torch_reference
def test_stop_ids_end_a_sequence_as_eos_does(model):
    free = generate(model, PROMPTS, NEW)
    first = int(free[0, 0])
    assert first != model.config.eos_token_id and (free[0, 1:] != model.config.pad_token_id).any()  # runs on freely
    out = generate(model, PROMPTS, NEW, stop_ids=[first])
    np.testing.assert_array_equal(out[0], [first] + [model.config.pad_token_id] * (NEW - 1))
    for row, unstopped in zip(out, free):  # every row is the free run up to its first stop id
        hit = np.flatnonzero(unstopped == first)
        end = hit[0] + 1 if hit.size else NEW
        np.testing.assert_array_equal(row[:end], unstopped[:end])
        assert (row[end:] == model.config.pad_token_id).all()
    np.testing.assert_array_equal(generate(model, PROMPTS, NEW, stop_ids=[first], stop_at_eos=False), free)


@pytest.mark.torch_reference
def test_on_token_streams_every_column_in_order(model):
    seen = []
    out = generate(model, PROMPTS, NEW, on_token=lambda step, tokens: seen.append((int(step), list(tokens))))
    assert [s for s, _ in seen] == list(range(NEW))
    np.testing.assert_array_equal(np.array([t for _, t in seen]).T, out)


@pytest.mark.parametrize("kwargs, message", [
    (dict(prompt_ids=[[]]), "at least one token"),
    (dict(prompt_ids=[[5, 500]]), "outside the vocabulary"),
    (dict(prompt_ids=[[5]], max_new_tokens=0), "max_new_tokens"),
    (dict(prompt_ids=[[5]], temperature=-1.0), "temperature"),
    (dict(prompt_ids=[[5]], temperature=1.0, top_p=0.0), "top_p"),
    (dict(prompt_ids=[[5]], max_new_tokens=10**6), "max_position_embeddings"),
])
@pytest.mark.torch_reference
def test_bad_arguments_fail_clearly(model, kwargs, message):
    kwargs = {"max_new_tokens": 4, **kwargs}
    with pytest.raises(ValueError, match=message):
        generate(model, **kwargs)


def test_generation_split_over_a_data_mesh_gives_one_devices_tokens(monkeypatch):
    import importlib

    import jax

    from tests.model_fixtures import tiny_model
    from zaya_jax.parallel.mesh import make_mesh

    generate_module = importlib.import_module("zaya_jax.infer.static_loop")

    model = tiny_model()
    prompts = [[5, 6, 7, 8, 9], [40, 3, 17], [11, 12, 13, 14, 15, 16, 17], [2, 9]]
    mesh = make_mesh({"data": 4}, jax.devices()[:4])
    decode, placements = generate_module._decode, []

    def recording_decode(graphdef, params, state, logits, *args, **kwargs):
        placements.append((len(logits.sharding.device_set), logits.sharding.is_fully_replicated))
        return decode(graphdef, params, state, logits, *args, **kwargs)
    monkeypatch.setattr(generate_module, "_decode", recording_decode)
    for sampling in ({}, {"temperature": 1.5, "top_k": 20, "seed": 3}):
        alone = generate(model, prompts, NEW, **sampling)
        np.testing.assert_array_equal(generate(model, prompts, NEW, mesh=mesh, **sampling), alone)
    assert placements == [(1, True), (4, False)] * 2  # the split run's rows really sat on 4 devices
    with pytest.raises(ValueError, match="multiple of 4 prompts"):
        generate(model, prompts[:3], NEW, mesh=mesh)
