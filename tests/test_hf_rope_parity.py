"""Proof against transformers for each RoPE scaling type on ZAYA's partial rotary (fp32, random weights).

One tiny model per case (head_dim 16, so 8 rotary dims: four frequencies; max_position_embeddings
16, original_max_position_embeddings 8), with sequences of 6 tokens (below both) and 24 (past
both), so every length-dependent choice is taken both ways: dynamic's base and longrope's short or
long factors. For each case: the training forward's logits and the LM loss's gradient of every
parameter; prefill of 5-token prompts padded to 10 (past original_max_position_embeddings: the
padding is not the sequence) and decode through the KV cache to position 23, step by step against
transformers' own cached decode (keys cached at earlier steps keep the frequencies of their step,
as there); an export read by `ZayaForCausalLM.from_pretrained` gives transformers' logits. The
`sliding` case composes both layer types, each with its own base and scaling (longrope on the
full layer, dynamic on the sliding one); `yarn` also runs at a curriculum phase's rope_theta.

transformers keeps dynamic's table between calls (until a call shorter than
max_position_embeddings): each comparison starts from a fresh rotary embedding (`fresh_rope`).
"""

import jax
import numpy as np
import pytest

import zaya_jax
from tests.hf_reference import assert_lm_gradients_match, hf_logits, jax_from_hf, make_hf_model
from zaya_jax.config import RopeScaling
from zaya_jax.infer import decode_step, prefill

pytestmark = pytest.mark.torch_reference  # every test compares with PyTorch transformers

ORIGINAL, MAX, SHORT, LONG = 8, 16, 6, 24
PROMPT, WIDTH = 5, 10


def _entry(theta: float, **scaling) -> dict:
    return {"rope_theta": theta, "partial_rotary_factor": 0.5, **scaling}


YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=ORIGINAL, beta_fast=0.8, beta_slow=0.064,
            mscale=0.8, mscale_all_dim=0.5)  # a correction range of non-integer ends: truncate matters
LONGROPE = dict(rope_type="longrope", short_factor=[1.0, 1.2, 1.5, 2.0], long_factor=[1.0, 2.0, 4.0, 8.0],
                original_max_position_embeddings=ORIGINAL)  # factor null: M / O = 2, attention factor 1.15
CASES = {
    "linear": {"rope_parameters": {"hybrid": _entry(100.0, rope_type="linear", factor=2.5)}},
    "dynamic": {"rope_parameters": {"hybrid": _entry(100.0, rope_type="dynamic", factor=3.0)}},
    "yarn": {"rope_parameters": {"hybrid": _entry(100.0, **YARN), "truncate": False}},
    "longrope": {"rope_parameters": {"hybrid": _entry(100.0, **LONGROPE)}},
    "llama3": {"rope_parameters": {"hybrid": _entry(100.0, rope_type="llama3", factor=4.0, low_freq_factor=1.0,
                                                    high_freq_factor=4.0, original_max_position_embeddings=ORIGINAL)}},
    "sliding": {"layer_types": ["hybrid_sliding", "hybrid"], "sliding_window": 6,
                "rope_parameters": {"hybrid": _entry(100.0, **LONGROPE),
                                    "hybrid_sliding": _entry(300.0, rope_type="dynamic", factor=2.0)}},
}


@pytest.fixture(scope="module", params=CASES, ids=CASES)
def case(request):
    hf = make_hf_model(seed=5, head_dim=16, max_position_embeddings=MAX, **CASES[request.param])
    return request.param, hf, jax_from_hf(hf)


def fresh_rope(hf):
    """transformers' rotary embedding as a new model has it (no dynamic table kept from earlier calls)."""
    hf.model.rotary_emb = type(hf.model.rotary_emb)(hf.config)
    return hf


def _ids(batch: int, seq: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, 97, (batch, seq))


def test_training_forward_logits_and_every_gradient(case):
    name, hf, model = case
    forward = jax.jit(lambda m, x: m(x))
    for seq in (SHORT, LONG):
        ids = _ids(2, seq)
        np.testing.assert_allclose(np.asarray(forward(model, ids)), hf_logits(fresh_rope(hf), ids), atol=1e-4, rtol=0,
                                   err_msg=f"{name}, {seq} tokens")
    unscaled = jax_from_hf(hf, rope_scaling=RopeScaling(), sliding_rope_scaling=RopeScaling())
    ids = _ids(2, LONG)
    assert np.abs(np.asarray(forward(unscaled, ids)) - np.asarray(forward(model, ids))).max() > 1e-2  # it acts
    assert_lm_gradients_match(fresh_rope(hf), model, ids)


def _hf_cached_decode(hf, ids: np.ndarray) -> list[np.ndarray]:
    """transformers' prefill of ids[:, :PROMPT], then one token per call through its cache ->
    the logits [B, V] at positions PROMPT - 1 .. S - 1."""
    import torch

    fresh_rope(hf)
    with torch.no_grad():
        out = hf(input_ids=torch.as_tensor(ids[:, :PROMPT]), use_cache=True)
        logits = [out.logits[:, -1].numpy()]
        for t in range(PROMPT, ids.shape[1]):
            out = hf(input_ids=torch.as_tensor(ids[:, t:t + 1]), cache=out.cache, use_cache=True)
            logits.append(out.logits[:, -1].numpy())
    return logits


def test_prefill_and_decode_through_the_cache(case):
    name, hf, model = case
    ids = _ids(2, LONG, seed=1)
    prompts = np.zeros((2, WIDTH), np.int32)
    prompts[:, :PROMPT] = ids[:, :PROMPT]
    lengths = np.full(2, PROMPT, np.int32)
    logits, state = jax.jit(prefill, static_argnums=3)(model, prompts, lengths, LONG)
    ours = [np.asarray(logits)]
    step = jax.jit(decode_step)
    for t in range(PROMPT, LONG):
        logits, state = step(model, state, ids[:, t])
        ours.append(np.asarray(logits))
    for t, (a, b) in enumerate(zip(ours, _hf_cached_decode(hf, ids), strict=True)):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=0, err_msg=f"{name}, position {PROMPT - 1 + t}")


def test_export_loads_in_transformers_with_equal_logits(case, tmp_path):
    from transformers import ZayaForCausalLM

    name, hf, model = case
    zaya_jax.save_hf(model, tmp_path / "export")
    reloaded = ZayaForCausalLM.from_pretrained(tmp_path / "export").eval()
    written, source = reloaded.config.rope_parameters, hf.config.rope_parameters
    for layer_type in set(hf.config.layer_types):  # the entries in use, as given (both are written)
        assert written[layer_type] == source[layer_type], layer_type
    assert written.get("truncate", True) == source.get("truncate", True)
    ids = _ids(2, LONG, seed=2)
    np.testing.assert_allclose(hf_logits(reloaded, ids), np.asarray(model(ids)), atol=1e-4, rtol=0, err_msg=name)


@pytest.mark.parametrize("case", ["yarn"], indirect=True)
def test_a_phase_rope_base_rotates_under_the_scaling(case):
    """A curriculum phase's rope_theta (hidden_states' override) is transformers' hybrid rope_theta under
    the same scaling: the model with that base there."""
    _, hf, model = case
    phase = 700.0
    ids = _ids(2, LONG, seed=3)
    hidden, _ = jax.jit(lambda m, x: m.hidden_states(x, rope_theta=phase))(model, ids)
    hf.config.rope_parameters["hybrid"]["rope_theta"] = phase
    try:
        theirs = hf_logits(fresh_rope(hf), ids)
    finally:
        hf.config.rope_parameters["hybrid"]["rope_theta"] = 100.0
        fresh_rope(hf)
    np.testing.assert_allclose(np.asarray(model.logits(hidden)), theirs, atol=1e-4, rtol=0)
    assert np.abs(theirs - hf_logits(hf, ids)).max() > 1e-2
