"""Prefill + token-by-token decode == the full forward; the decode state's shapes and size."""

import jax
import numpy as np
import pytest

from tests.hf_reference import jax_from_hf, make_hf_model
from zaya_jax.config_files import load_config_file, model_config
from zaya_jax.infer import cache_numbers_per_token, decode_step, prefill, quantize_model, state_shapes
from zaya_jax.infer.decode import stacked_experts_dispatch
from zaya_jax.native import grouped_matmul

SEQ = 12
# Prompts of different lengths, one of a single token. The tiny model has 4 experts: a decode batch of
# up to 4 gathers each token's expert weights, a larger one runs the model's dispatch backend.
GATHERED = np.array([1, 6, 4])
DISPATCHED = np.array([1, 6, 4, 3, 9])


@pytest.fixture(scope="module")
def hf_model():
    return make_hf_model(seed=0)


def _decode_logits(model, ids: np.ndarray, lengths: np.ndarray) -> dict[tuple[int, int], np.ndarray]:
    """Prefill ids[b, :lengths[b]], then feed ids[b, lengths[b]:] one token at a time.

    -> {(b, position): logits [V]} for every position from each prompt's last token on.
    """
    b, s = ids.shape
    width = 16
    prompts = np.zeros((b, width), np.int32)
    for i, n in enumerate(lengths):
        prompts[i, :n] = ids[i, :n]
    logits, state = jax.jit(prefill, static_argnums=3)(model, prompts, lengths, width + s)
    out = {(i, int(n) - 1): np.asarray(logits[i]) for i, n in enumerate(lengths)}
    step = jax.jit(decode_step)
    for t in range(s - int(lengths.min())):
        positions = lengths + t
        logits, state = step(model, state, ids[np.arange(b), np.minimum(positions, s - 1)])
        np.testing.assert_array_equal(np.asarray(state.lengths), positions + 1)
        out.update({(i, int(p)): np.asarray(logits[i]) for i, p in enumerate(positions) if p < s})
    return out


# layout, scan over layers, compute dtype, decode batch, MoE backend. With the native CPU grouped
# matmul (auto), prefill and decode read each layer's experts in place from the stacked weights.
VARIANTS = {
    "native-scan-fp32-dispatched": ("native", True, "float32", DISPATCHED, "auto"),
    "base-loop-bf16-gathered": ("base", False, "bfloat16", GATHERED, "auto"),
    "tiles-loop-fp32-dispatched": ("native", False, "float32", DISPATCHED, "tiles"),
    "tiles-scan-fp32-gathered": ("native", True, "float32", GATHERED, "tiles"),
    "int4-gathered": ("native", True, "float32", GATHERED, "auto"),
}


@pytest.mark.torch_reference
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_incremental_decode_matches_full_forward_at_every_position(hf_model, variant):
    layout, scan, dtype, lengths, backend = VARIANTS[variant]
    model = jax_from_hf(hf_model, layout=layout, scan_layers=scan, dtype=dtype, moe_backend=backend)
    if variant.startswith("int4"):  # the quantized model decodes exactly as its own full forward
        model = quantize_model(model, "int4", group_size=8)
    in_place = backend == "auto" and not variant.startswith("int4")
    assert (stacked_experts_dispatch(model) is not None) == (in_place and grouped_matmul.available())
    ids = np.random.default_rng(0).integers(3, hf_model.config.vocab_size, (len(lengths), SEQ))
    full = np.asarray(jax.jit(lambda m, x: m(x))(model, ids))  # float32 logits, also in bf16
    decoded = _decode_logits(model, ids, lengths)
    assert len(decoded) == sum(SEQ - n + 1 for n in lengths)
    for (b, pos), logits in decoded.items():
        np.testing.assert_allclose(logits, full[b, pos], atol=1e-4, rtol=0, err_msg=f"sequence {b}, position {pos}")


def test_zaya1_cache_holds_512_numbers_per_token_per_attention_layer():
    cfg = model_config(load_config_file("configs/zaya1_base.py"))
    assert cache_numbers_per_token(cfg) == 512
    mha = 2 * 16 * cfg.head_dim  # 16-head MHA at hidden 2048: keys and values of 16 heads of 128
    assert mha // cache_numbers_per_token(cfg) == 8
    state = state_shapes(cfg, batch=3, cache_size=100)
    assert isinstance(state.keys, jax.ShapeDtypeStruct)
    assert state.keys.shape == state.values.shape == (40, 3, 100, 2, 128)
    assert state.keys.dtype == np.dtype("bfloat16")
    # conv carry: one pre-conv and one depthwise column of the 1,280 packed q|k channels
    assert state.carry.packed.shape == state.carry.depthwise.shape == (40, 3, 10, 128)
    assert state.carry.value_delayed.shape == (40, 3, 1, 128)
    assert state.lengths.shape == (3,)
