"""Parity with the real transformers.ZayaForCausalLM (fp32, CPU)."""

import jax
import numpy as np
import pytest

import zaya_jax
from tests.hf_reference import hf_logits, jax_from_hf, make_hf_model

pytestmark = pytest.mark.torch_reference  # every test compares with PyTorch transformers


@pytest.fixture(scope="module")
def hf_model():
    return make_hf_model(seed=0)


@pytest.mark.parametrize("batch,seq", [(2, 13), (1, 1), (3, 32)])
def test_logits_match_hf(hf_model, batch, seq):
    ids = np.random.default_rng(seq).integers(0, hf_model.config.vocab_size, (batch, seq))
    model = jax_from_hf(hf_model, moe_backend="dense")
    ours = np.asarray(jax.jit(lambda m, x: m(x))(model, ids))
    theirs = hf_logits(hf_model, ids)
    assert ours.shape == (batch, seq, hf_model.config.vocab_size)
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)


def test_routing_is_not_trivial(hf_model):
    ids = np.random.default_rng(1).integers(0, hf_model.config.vocab_size, (4, 32))
    _, stats = jax_from_hf(hf_model).forward_with_stats(ids)
    used = (np.asarray(stats.expert_counts)[:, :-1] > 0).sum(axis=1)
    assert (used >= 2).all(), f"experts used per layer: {used}"


def test_save_hf_loads_in_transformers_with_identical_logits(hf_model, tmp_path):
    from transformers import ZayaForCausalLM
    model = jax_from_hf(hf_model)
    zaya_jax.save_hf(model, tmp_path / "ckpt")
    reloaded = ZayaForCausalLM.from_pretrained(tmp_path / "ckpt").eval()
    ids = np.random.default_rng(2).integers(0, hf_model.config.vocab_size, (2, 17))
    np.testing.assert_allclose(hf_logits(reloaded, ids), np.asarray(model(ids)), atol=1e-4, rtol=0)
    again = zaya_jax.load_hf(tmp_path / "ckpt")
    np.testing.assert_array_equal(np.asarray(again(ids)), np.asarray(model(ids)))
