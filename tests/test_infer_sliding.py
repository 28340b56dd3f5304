"""Decoding sliding-window layers: the ring buffer stops at the window, incremental decode equals
the full forward past it, and greedy generation equals transformers' `generate`."""

import jax
import numpy as np
import pytest

from tests.hf_reference import jax_from_hf, make_hf_model
from tests.model_fixtures import tiny_model
from tests.test_infer_decode import _decode_logits
from zaya_jax.infer import cache_numbers_per_token, state_shapes
from zaya_jax.infer.cache import cache_bytes
from zaya_jax.engine import generate

WINDOW = 6
MIXED = dict(layer_types=("hybrid_sliding", "hybrid"), sliding_window=WINDOW, sliding_rope_theta=500.0)


def test_ring_buffer_stops_growing_at_the_window():
    model = tiny_model(**MIXED)
    cfg = model.config
    small, large = state_shapes(cfg, batch=2, cache_size=40), state_shapes(cfg, batch=2, cache_size=400)
    assert small.keys.shape == (1, 2, 40, 2, 8) and large.keys.shape == (1, 2, 400, 2, 8)
    assert small.window_keys.shape == large.window_keys.shape == (1, 2, WINDOW, 2, 8)
    assert state_shapes(cfg, batch=2, cache_size=4).window_keys.shape[2] == 4  # never more than T
    assert cache_numbers_per_token(cfg) == 2 * 2 * 8
    per_slot = 2 * 2 * 2 * 8 * 4  # batch, keys+values, K, H, fp32
    assert cache_bytes(cfg, 2, 400) == per_slot * (400 + WINDOW)


@pytest.mark.parametrize("scan", [True, False])
def test_incremental_decode_past_the_window_matches_full_forward(scan):
    """Prompts of 2, 9 and 14 tokens (the longer ones past the window of 6), decoded to 30."""
    model = tiny_model(**MIXED, scan_layers=scan)
    ids = np.random.default_rng(2).integers(3, 64, (3, 30))
    lengths = np.array([2, 9, 14])
    full = np.asarray(jax.jit(lambda m, x: m(x))(model, ids))
    for (b, position), logits in _decode_logits(model, ids, lengths).items():
        np.testing.assert_allclose(logits, full[b, position], atol=1e-4, err_msg=f"sequence {b} position {position}")


@pytest.mark.torch_reference
def test_greedy_generation_past_the_window_equals_transformers():
    """30 greedy tokens after prompts of 5 and 12 tokens (window 8): positions up to 41."""
    import torch

    rope = {"hybrid": {"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.5},
            "hybrid_sliding": {"rope_type": "default", "rope_theta": 300.0, "partial_rotary_factor": 0.5}}
    hf = make_hf_model(seed=4, num_hidden_layers=4, sliding_window=8, rope_parameters=rope,
                       layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding", "hybrid"])
    model = jax_from_hf(hf)
    prompts = [list(np.random.default_rng(1).integers(3, 97, n)) for n in (5, 12)]
    ours = generate(model, prompts, 30, stop_at_eos=False)
    for prompt, tokens in zip(prompts, ours):
        with torch.no_grad():
            out = hf.generate(torch.as_tensor([prompt]), max_new_tokens=30, min_new_tokens=30, do_sample=False)
        np.testing.assert_array_equal(tokens, out[0, len(prompt):].numpy())
    unwindowed = generate(jax_from_hf(hf, sliding_window=64), prompts, 30, stop_at_eos=False)
    assert (unwindowed != ours).any()  # the window acts on these tokens
