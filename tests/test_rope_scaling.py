"""RoPE scaling against numpy written from transformers' formulas (modeling_rope_utils, 5.25), no torch.

For each type the cos / sin tables of zaya_jax.model.rope equal numpy's, computed here from the
published formulas with dim = the rotary dims (ZAYA's partial rotary), at lengths below and past
max_position_embeddings (M = 16) and original_max_position_embeddings (O = 8); how the two layer
types and a curriculum phase's base compose (layer_kinds); and ModelConfig refusing, naming the key,
a scaling it cannot compute. The proof against transformers itself is tests/test_hf_rope_parity.py.
"""

import dataclasses
import math

import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from zaya_jax.config import ConfigError, ModelConfig, RopeScaling
from zaya_jax.config_files import model_config, model_section
from zaya_jax.model.layer_types import layer_kinds
from zaya_jax.model.rope import rope_cos_sin
from zaya_jax.checkpoints.orbax_checkpoint import config_json
from zaya_jax.engine import generate

R, THETA, M, O = 8, 100.0, 16, 8


def spec_inv_freq(s: dict, theta: float, dim: int, max_pos: int, seq_len: int) -> tuple[np.ndarray, float]:
    """(inverse frequencies [dim/2], attention factor) as transformers' init functions define them."""
    j = np.arange(0, dim, 2) / dim
    inv = theta ** -j
    kind, factor = s.get("rope_type", "default"), s.get("factor")
    if kind == "linear":
        return inv / factor, 1.0
    if kind == "dynamic":  # the base is raised once the sequence is longer than max_pos
        if seq_len <= max_pos:
            return inv, 1.0
        base = theta * (factor * seq_len / max_pos - (factor - 1)) ** (dim / (dim - 2))
        return base ** -j, 1.0
    original = s.get("original_max_position_embeddings")
    if kind == "yarn":
        factor = factor or max_pos / original
        mscale = lambda scale, m=1.0: 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0  # noqa: E731
        attention = s.get("attention_factor") or (mscale(factor, s["mscale"]) / mscale(factor, s["mscale_all_dim"])
                                                  if s.get("mscale") and s.get("mscale_all_dim") else mscale(factor))
        turns = lambda r: dim * math.log(original / (r * 2 * math.pi)) / (2 * math.log(theta))  # noqa: E731
        low, high = turns(s.get("beta_fast", 32)), turns(s.get("beta_slow", 1))
        if s.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        keep = 1 - np.clip((np.arange(dim // 2) - low) / (high - low or 0.001), 0, 1)  # 1: extrapolate
        return inv / factor * (1 - keep) + inv * keep, attention
    if kind == "longrope":
        factor = factor or max_pos / original
        attention = s.get("attention_factor") or (1.0 if factor <= 1 else
                                                  math.sqrt(1 + math.log(factor) / math.log(original)))
        chosen = s["long_factor"] if seq_len > original else s["short_factor"]
        return inv / np.asarray(chosen), attention
    if kind == "llama3":
        wavelen = 2 * math.pi / inv
        low_wl, high_wl = original / s["low_freq_factor"], original / s["high_freq_factor"]
        smooth = (original / wavelen - s["low_freq_factor"]) / (s["high_freq_factor"] - s["low_freq_factor"])
        blended = (1 - smooth) * inv / factor + smooth * inv
        return np.where(wavelen > low_wl, inv / factor, np.where(wavelen < high_wl, inv, blended)), 1.0
    return inv, 1.0


def spec_tables(s: dict, positions: np.ndarray, theta: float = THETA, seq_len: int | None = None):
    inv, attention = spec_inv_freq(s, theta, R, M, int(positions.max()) + 1 if seq_len is None else seq_len)
    angles = positions[..., None] * np.concatenate([inv, inv])
    return np.cos(angles) * attention, np.sin(angles) * attention


YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=O, beta_fast=0.8, beta_slow=0.064)
SCALINGS = {
    "default": {},
    "linear": dict(rope_type="linear", factor=2.5),
    "dynamic": dict(rope_type="dynamic", factor=3.0),
    "yarn": YARN,
    "yarn-untruncated-mscale": dict(YARN, truncate=False, mscale=0.8, mscale_all_dim=0.5),
    "yarn-attention-factor-derived-factor": dict(YARN, factor=0.0, attention_factor=1.3),
    "longrope": dict(rope_type="longrope", short_factor=(1.0, 1.2, 1.5, 2.0), long_factor=(1.0, 2.0, 4.0, 8.0),
                     original_max_position_embeddings=O),
    "llama3": dict(rope_type="llama3", factor=4.0, original_max_position_embeddings=O, low_freq_factor=1.0,
                   high_freq_factor=4.0),
}


@pytest.mark.parametrize("seq", [6, 12, 24])  # below O, between O and M, past M
@pytest.mark.parametrize("name", SCALINGS)
def test_tables_equal_the_formulas(name, seq):
    positions = np.stack([np.arange(seq), np.arange(seq) // 2])  # the batch's longest row sets the length
    cos, sin = rope_cos_sin(jnp.asarray(positions), R, THETA, RopeScaling(**SCALINGS[name]), M)
    want_cos, want_sin = spec_tables(SCALINGS[name], positions)
    np.testing.assert_allclose(np.asarray(cos), want_cos, atol=2e-6, rtol=0)
    np.testing.assert_allclose(np.asarray(sin), want_sin, atol=2e-6, rtol=0)


def test_the_variants_exercise_their_keys():
    """Each key the cases vary changes the tables (truncate included), so the test above compares them."""
    positions = np.arange(24)[None]
    tables = {name: spec_tables(s, positions)[0] for name, s in SCALINGS.items()}
    assert all(np.abs(tables[name] - tables["default"]).max() > 1e-3 for name in SCALINGS if name != "default")
    untruncated = dict(YARN, truncate=False)
    assert np.abs(spec_tables(untruncated, positions)[0] - tables["yarn"]).max() > 1e-3


@pytest.mark.parametrize("name", ["dynamic", "longrope"])
def test_an_explicit_length_replaces_the_positions(name):
    """Prefill passes its longest prompt (padding is not the sequence); decode's one position is its own."""
    positions = jnp.broadcast_to(jnp.arange(20), (1, 20))
    cos, _ = rope_cos_sin(positions, R, THETA, RopeScaling(**SCALINGS[name]), M, seq_len=jnp.asarray(5))
    np.testing.assert_allclose(np.asarray(cos), spec_tables(SCALINGS[name], np.asarray(positions), seq_len=5)[0],
                               atol=2e-6)
    assert np.abs(np.asarray(cos) - spec_tables(SCALINGS[name], np.asarray(positions))[0]).max() > 1e-3


def test_layer_types_and_a_phase_base_compose():
    """Full layers: the phase's base under rope_scaling; sliding layers: their own base and scaling."""
    cfg = ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=16,
                      num_experts=4, moe_intermediate_size=16, router_hidden_size=8, max_position_embeddings=M,
                      rope_theta=THETA, rope_scaling=SCALINGS["yarn"], sliding_rope_theta=300.0,
                      sliding_rope_scaling=SCALINGS["dynamic"], layer_types=("hybrid_sliding", "hybrid"),
                      sliding_window=4)
    positions = np.broadcast_to(np.arange(24), (2, 24))
    kinds = layer_kinds(cfg, jnp.asarray(positions), rope_theta=700.0)
    np.testing.assert_allclose(np.asarray(kinds.full_rope[0]), spec_tables(SCALINGS["yarn"], positions, 700.0)[0],
                               atol=2e-6)
    np.testing.assert_allclose(np.asarray(kinds.sliding_rope[1]),
                               spec_tables(SCALINGS["dynamic"], positions, 300.0)[1], atol=2e-6)
    # a checkpoint saved in that phase records its base beside the scaling, and rebuilds both
    config = ml_collections.ConfigDict({"model": model_section(**dataclasses.asdict(cfg))})
    saved = config_json(config, rope_theta=700.0)
    assert model_config(ml_collections.ConfigDict(saved)) == cfg.replace(rope_theta=700.0)


BAD = {
    "an unknown type": (dict(rope_type="proportional"), "rope_scaling.rope_type='proportional'"),
    "a key the type does not read": (dict(rope_type="linear", factor=2.0, beta_fast=4.0), "rope_scaling.beta_fast"),
    "an unknown key": (dict(rope_type="linear", scale=2.0), "rope_scaling.scale: unknown key"),
    "yarn without its original context": (dict(rope_type="yarn", factor=2.0), "original_max_position_embeddings"),
    "a zero linear factor": (dict(rope_type="linear", factor=0.0), "rope_scaling.factor must be > 0"),
    "longrope factors of the wrong length": (dict(rope_type="longrope", short_factor=(1.0,), long_factor=(1.0,) * 4,
                                                  original_max_position_embeddings=8), "short_factor must list 4"),
    "a negative attention factor": (dict(YARN, attention_factor=-1.0), "attention_factor must be a non-negative"),
}


@pytest.mark.parametrize("case", BAD)
def test_a_scaling_it_cannot_compute_is_refused_naming_the_key(case):
    scaling, named = BAD[case]
    with pytest.raises(ConfigError) as err:
        ModelConfig(head_dim=16, rope_scaling=scaling)
    assert "\n" not in str(err.value) and named in str(err.value) and "model." in str(err.value)


def test_dynamic_lifts_the_generation_limit():
    assert ModelConfig().position_limit == ModelConfig().max_position_embeddings
    assert ModelConfig(rope_scaling=SCALINGS["dynamic"]).position_limit is None
    assert ModelConfig(sliding_rope_scaling=SCALINGS["dynamic"]).position_limit == 32_768  # no sliding layers


def test_generation_goes_past_max_position_embeddings_only_with_dynamic():
    from tests.model_fixtures import tiny_model

    prompt = [[3, 4, 5, 6]]
    with pytest.raises(ValueError, match="max_position_embeddings=8"):
        generate(tiny_model(max_position_embeddings=8), prompt, 10)
    dynamic = tiny_model(max_position_embeddings=8, rope_scaling=RopeScaling(**SCALINGS["dynamic"]))
    tokens = generate(dynamic, prompt, 10, stop_at_eos=False)
    assert tokens.shape == (1, 10)
