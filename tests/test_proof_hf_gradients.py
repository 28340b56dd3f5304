"""Proof against transformers: logits AND the LM-loss gradient of every parameter, fp32.

The config is deliberately odd-shaped (hidden 44, 6 query heads over 2 KV heads, head_dim 12,
vocab 101, 5 experts, 3 layers); every parameter and every balancing bias, the skip slot's
included, is random, and the skip slot is taken by a share of the tokens (asserted). HF's
`ZayaForCausalLM` implements the native layout (a skip-routed token outputs 0). The loss is
written here twice, once in torch and once in jax: mean next-token cross-entropy.

The `sliding` case runs the same proof on 4 layers of mixed types (sliding, full, sliding, full;
window 8, its own RoPE base) over 44 tokens, and shows the window acting: the same weights with
a window spanning the whole sequence give different logits.
"""

import jax
import numpy as np
import pytest

from tests.hf_reference import assert_lm_gradients_match, hf_logits, jax_from_hf, make_hf_model

pytestmark = pytest.mark.torch_reference  # every test compares with PyTorch transformers

ODD = dict(vocab_size=101, hidden_size=44, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2,
           head_dim=12, num_experts=5, moe_intermediate_size=14, router_hidden_size=10,
           experts_implementation="eager")  # the readable per-expert loop (grouped_mm needs 16-byte strides)
SLIDING = dict(ODD, num_hidden_layers=4, layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding", "hybrid"],
               sliding_window=8, rope_parameters={
                   "hybrid": {"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.5},
                   "hybrid_sliding": {"rope_type": "default", "rope_theta": 300.0, "partial_rotary_factor": 0.5}})
CASES = {"full": (ODD, (3, 19), 11), "sliding": (SLIDING, (2, 44), 16)}  # config, ids shape, bias seed


@pytest.fixture(scope="module", params=CASES, ids=CASES)
def case(request):
    import torch

    config, shape, bias_seed = CASES[request.param]
    model = make_hf_model(seed=3, **config)
    gen = torch.Generator().manual_seed(bias_seed)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("balancing_biases"):  # the skip slot competes like any expert
                buf.copy_(0.15 * torch.randn(buf.shape, generator=gen))
    return model, np.random.default_rng(7).integers(0, config["vocab_size"], shape)


def test_logits_and_every_gradient_match_torch_autograd(case):
    hf_model, IDS = case
    model = jax_from_hf(hf_model)  # moe_backend auto: the dropless backend training uses here
    logits, stats = jax.jit(lambda m, x: m.forward_with_stats(x))(model, IDS)
    skip_counts = np.asarray(stats.expert_counts)[:, -1]
    assert (skip_counts > 0).all() and (skip_counts < IDS.size).all(), f"skip tokens per layer: {skip_counts}"

    theirs = hf_logits(hf_model, IDS)
    np.testing.assert_allclose(np.asarray(logits), theirs, atol=1e-4, rtol=0)
    if model.config.layer_types:  # the window acts: one spanning the whole sequence computes something else
        unwindowed = jax_from_hf(hf_model, sliding_window=IDS.shape[1])
        assert np.abs(np.asarray(unwindowed(IDS)) - theirs).max() > 1e-2

    assert_lm_gradients_match(hf_model, model, IDS)
