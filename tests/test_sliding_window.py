"""Sliding-window CCA layers (model.layer_types "hybrid_sliding"): config errors, packed documents,
HF config.json both schemas (and transformers loading our export), the planner. The torch proofs
of logits and gradients are in tests/test_proof_hf_gradients.py, of greedy generation in
tests/test_infer_sliding.py."""

import json

import jax
import numpy as np
import pytest

import zaya_jax
from tests.model_fixtures import TINY, tiny_model
from zaya_jax.config import ConfigError

MIXED = dict(layer_types=("hybrid_sliding", "hybrid"), sliding_window=6, sliding_rope_theta=500.0)
IDS = np.random.default_rng(5).integers(3, 64, (2, 30))
NATIVE = dict(layout="native", router_norm_eps=TINY.rms_norm_eps, residual_in_fp32=True)  # what transformers runs


@pytest.mark.parametrize("changes,match", [
    (dict(layer_types=("hybrid", "sliding")), r"model.layer_types=.*must be one of"),
    (dict(layer_types=("hybrid_sliding",), sliding_window=4), r"lists 1 layers but model.num_layers is 2"),
    (dict(layer_types=("hybrid_sliding", "hybrid")), r"model.sliding_window=0 .*set model.sliding_window"),
    (dict(sliding_window=-3), r"model.sliding_window must be a non-negative integer"),
    (dict(sliding_rope_theta=0.0), r"model.sliding_rope_theta must be > 0"),
])
def test_bad_layer_type_settings_are_named(changes, match):
    with pytest.raises(ConfigError, match=match):
        TINY.replace(**changes)


def test_every_layer_full_is_spelled_empty():
    assert TINY.replace(layer_types=["hybrid", "hybrid"]).layer_types == ()
    assert TINY.replace(**MIXED).sliding_layers == (True, False)


def test_window_and_sliding_rope_act():
    model = tiny_model(**MIXED)
    logits = np.asarray(model(IDS))
    for other in (dict(MIXED, sliding_window=30), dict(MIXED, sliding_rope_theta=10_000.0)):
        changed = np.asarray(tiny_model(**other)(IDS))  # same seed: the same weights
        assert np.abs(changed - logits).max() > 1e-3, other


def test_packed_documents_equal_each_document_alone():
    """Window 6 inside packed documents of 13 and 17 tokens: each document's logits equal its run
    alone, so a key is visible only when in the query's document, causal and within the window."""
    model = tiny_model(**MIXED)
    ids = IDS[:1]
    segments = np.array([[1] * 13 + [2] * 17])
    packed = np.asarray(model(ids, segment_ids=segments))
    np.testing.assert_allclose(packed[:, :13], np.asarray(model(ids[:, :13])), atol=2e-5)
    np.testing.assert_allclose(packed[:, 13:], np.asarray(model(ids[:, 13:])), atol=2e-5)


@pytest.mark.parametrize("schema", ["native", "original"])
def test_hf_config_round_trip(schema, tmp_path):
    model = tiny_model(**MIXED, **(NATIVE if schema == "native" else {}))
    zaya_jax.save_hf(model, tmp_path / "ckpt", schema=schema)  # the export check reads it back
    written = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert written["sliding_window"] == 6
    if schema == "native":
        assert written["layer_types"] == ["hybrid_sliding", "hybrid"]
        assert written["rope_parameters"]["hybrid_sliding"]["rope_theta"] == 500.0
        assert written["rope_parameters"]["hybrid"]["rope_theta"] == TINY.rope_theta
    else:
        assert (written["swa_layers"], written["swa_rope_theta"]) == ([True, False], 500.0)
    again = zaya_jax.load_hf(tmp_path / "ckpt")
    assert (again.config.layer_types, again.config.sliding_window, again.config.sliding_rope_theta) == (
        MIXED["layer_types"], 6, 500.0)
    np.testing.assert_array_equal(np.asarray(again(IDS)), np.asarray(model(IDS)))


def test_hf_config_errors_name_the_key():
    from zaya_jax.checkpoints.hf_config import HFCheckpointError, hf_config_from_model, model_config_from_hf
    native = hf_config_from_model(TINY.replace(**MIXED, layout="native"), "native")
    with pytest.raises(HFCheckpointError, match="sliding_window is null"):
        model_config_from_hf({**native, "sliding_window": None})
    with pytest.raises(HFCheckpointError, match="layer_types .* not all among"):
        model_config_from_hf({**native, "layer_types": ["hybrid", "chunked"]})
    original = hf_config_from_model(TINY.replace(**MIXED), "original")
    with pytest.raises(HFCheckpointError, match="swa_layers must list one boolean per CCA layer"):
        model_config_from_hf({**original, "swa_layers": [True]})
    assert jax.tree.leaves(model_config_from_hf(original)[0].sliding_layers) == [True, False]


@pytest.mark.parametrize("window", [None, 16])
def test_planner_counts_the_keys_xla_computes(window):
    """The planner's attention-score FLOPs (2 x 2 N H keys per query) against XLA's cost analysis of
    the XLA attention path at S = 512: a window of 16 computes about a quarter of the full keys."""
    from zaya_jax.model.attention_core import xla_attention
    from zaya_jax.planner.step_flops import attention_keys_per_query
    seq, heads, dim = 512, 4, 64
    q = jax.ShapeDtypeStruct((1, seq, heads, dim), np.float32)
    kv = jax.ShapeDtypeStruct((1, seq, 2, dim), np.float32)
    compiled = jax.jit(lambda q, k, v: xla_attention(q, k, v, None, window)).lower(q, kv, kv).compile()
    analysis = compiled.cost_analysis()
    xla_flops = (analysis[0] if isinstance(analysis, list) else analysis)["flops"]
    keys = attention_keys_per_query(seq, "xla", window)
    assert 2 * 2 * heads * dim * seq * keys == pytest.approx(xla_flops, rel=0.05)
    if window:
        assert attention_keys_per_query(seq, "xla") > 3.5 * keys  # blocks of 64 rows: 77 keys against 288
        visible = window - (window - 1) * window / 2 / seq  # the first window - 1 queries see fewer
        assert attention_keys_per_query(seq, "pallas", window) == pytest.approx(visible)


def test_planner_cache_bytes_stop_at_the_window():
    from zaya_jax.model.accounting import model_summary
    from zaya_jax.planner.step_flops import mean_attention_keys
    cfg = TINY.replace(**MIXED)
    summary = model_summary(cfg)
    assert summary["kv_cache_bytes_per_token"] == 1 * 2 * 2 * 8 * 2  # one full layer, K and V of 2 x 8, bf16
    assert summary["kv_cache_window_bytes"] == 6 * 1 * 2 * 2 * 8 * 2
    windowed = (1 + 2 + 3 + 4 + 5 + 6 * 59) / 64  # window 6 over 64 queries; full: 65 / 2
    assert mean_attention_keys(cfg, 64, "pallas") == pytest.approx((windowed + 65 / 2) / 2)


def test_pallas_kernel_in_the_model_equals_the_xla_path():
    """kernels.attention=pallas (interpret mode here) through the model's per-layer lax.cond."""
    ids = IDS[:1, :12]
    np.testing.assert_allclose(np.asarray(tiny_model(**MIXED, attention_kernel="pallas")(ids)),
                               np.asarray(tiny_model(**MIXED)(ids)), atol=2e-5)


def test_a_phase_rope_theta_moves_the_full_layers_only():
    """hidden_states(rope_theta=...) (a curriculum phase's base) leaves an all-sliding model as it is."""
    sliding = tiny_model(layer_types=("hybrid_sliding",) * 2, sliding_window=6)
    mixed = tiny_model(**MIXED)
    for model, moves in ((sliding, False), (mixed, True)):
        base, phase = (np.asarray(jax.jit(lambda m, t=t: m.hidden_states(IDS[:1], rope_theta=t)[0])(model))
                       for t in (None, 77.0))
        assert (np.abs(phase - base).max() > 1e-3) == moves


def test_planner_activations_shrink_with_the_window():
    """XLA path, no remat, S = 2048: a sliding layer's probabilities span its query block (128 rows)
    plus the window, not the sequence, in the saved and the live activations."""
    from zaya_jax.planner.step_plan import StepShape, activation_memory, probability_widths
    cfg = TINY.replace(**MIXED)
    assert probability_widths(cfg, 2048) == [128 + 5, 2048]
    mesh = dict(data=1, fsdp=1, expert=1, tensor=1, context=1)
    windowed, full = (activation_memory(c, mesh, StepShape(1, 2048, platform="cpu")) for c in (cfg, TINY))
    probs = 2048 * 2 * 4 * 4  # tokens x 2 N per key x fp32, per key of width
    assert full["activations_saved"] - windowed["activations_saved"] == pytest.approx(probs * (2048 - 133))
    assert windowed["activations_live_layer"] == full["activations_live_layer"]  # the full layer's
    all_sliding = activation_memory(cfg.replace(layer_types=("hybrid_sliding",) * 2), mesh, StepShape(1, 2048))
    assert all_sliding["activations_live_layer"] < full["activations_live_layer"]


@pytest.mark.torch_reference
def test_save_hf_loads_in_transformers_with_its_layer_types_and_logits(tmp_path):
    from transformers import ZayaForCausalLM

    from tests.hf_reference import hf_logits
    model = tiny_model(**MIXED, **NATIVE)
    zaya_jax.save_hf(model, tmp_path / "ckpt")
    reloaded = ZayaForCausalLM.from_pretrained(tmp_path / "ckpt").eval()
    assert reloaded.config.layer_types == ["hybrid_sliding", "hybrid"] and reloaded.config.sliding_window == 6
    assert reloaded.config.rope_parameters["hybrid_sliding"]["rope_theta"] == 500.0
    np.testing.assert_allclose(hf_logits(reloaded, IDS), np.asarray(model(IDS)), atol=1e-4, rtol=0)
