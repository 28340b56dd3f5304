"""The blocked XLA attention equals the unblocked fp32 reference, values and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.attention_reference import attention_reference
from zaya_jax.model.attention_core import query_block_size, xla_attention


@pytest.mark.parametrize("seq,window", [(7, None), (200, None), (200, 9)])  # window 9: blocks read from key 56, 120
@pytest.mark.parametrize("packed", [False, True])
def test_blocked_attention_matches_reference(seq, packed, window):
    keys = jax.random.split(jax.random.PRNGKey(seq), 4)
    q = jax.random.normal(keys[0], (2, seq, 8, 16))
    k, v = (jax.random.normal(key, (2, seq, 2, 16)) for key in keys[1:3])
    segments = jnp.sort(jax.random.randint(keys[3], (2, seq), 1, 4), axis=1) if packed else None
    cotangent = jax.random.normal(keys[3], q.shape)

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v) * cotangent)
    ours = xla_attention(q, k, v, segments, window)
    ref = attention_reference(q, k, v, segment_ids=segments, causal=True, window=window)
    np.testing.assert_allclose(ours, ref, atol=2e-5)
    if window is not None:  # the window acts
        assert np.abs(ref - attention_reference(q, k, v, segment_ids=segments)).max() > 1e-2
    grads = jax.grad(loss(lambda q, k, v: xla_attention(q, k, v, segments, window)), argnums=(0, 1, 2))(q, k, v)
    ref_grads = jax.grad(loss(lambda q, k, v: attention_reference(q, k, v, segment_ids=segments, window=window)),
                         argnums=(0, 1, 2))(q, k, v)
    for g, r in zip(grads, ref_grads):
        np.testing.assert_allclose(g, r, atol=5e-5)


def test_window_skips_keys_before_it():
    """Window 20, query blocks of 64: NaN values at keys 0-63 reach the blocks that read them (up to
    query 83) and no later block, which starts reading past them (block 2 at key 109)."""
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    q = jax.random.normal(keys[0], (1, 256, 4, 16))
    k, v = (jax.random.normal(key, (1, 256, 2, 16)) for key in keys[1:])
    out = xla_attention(q, k, v.at[:, :64].set(jnp.nan), None, 20)
    assert np.isnan(out[:, 64:83]).all() and np.isfinite(out[:, 128:]).all()


def test_query_blocks_are_bounded():
    assert query_block_size(200) == 64             # 4 blocks, the last one partial
    assert query_block_size(32768) == 2048         # never more than 16 blocks
