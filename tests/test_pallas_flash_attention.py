"""cca_flash_attention (Pallas, interpret mode on CPU) against attention_reference: values and
gradients; plus a check that the kernels lower to Triton IR for CUDA and ROCm."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from pallas_kernels import attention_reference, cca_flash_attention, lower_for_gpu


def _packed_segments(batch: int, seq: int, seed: int) -> jax.Array:
    """[B, S] int32 ids of documents packed back to back, random lengths."""
    rng = np.random.default_rng(seed)
    ids = np.cumsum(rng.random((batch, seq)) < 0.15, axis=1)
    return jnp.asarray(ids, jnp.int32)


def _inputs(batch, seq, heads, kv_heads, dim, dtype, seed=0):
    kq, kk, kv, kd = jax.random.split(jax.random.PRNGKey(seed), 4)
    q = jax.random.normal(kq, (batch, seq, heads, dim), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (batch, seq, kv_heads, dim), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (batch, seq, kv_heads, dim), jnp.float32).astype(dtype)
    do = jax.random.normal(kd, (batch, seq, heads, dim), jnp.float32).astype(dtype)
    return q, k, v, do


def _value_and_grads(fn, q, k, v, do):
    out, vjp = jax.vjp(fn, q, k, v)
    return (out, *vjp(do))


# (batch, seq, heads, kv_heads, dim, causal, segments, sm_scale, blocks fwd q/k + bwd q/k, dtype, window)
CASES = {
    "gqa_ragged_tail": (1, 40, 4, 2, 16, True, False, None, (16, 16, 16, 32), jnp.float32, None),
    "bidirectional_segments": (1, 37, 2, 2, 16, False, True, 0.3, (32, 16, 16, 16), jnp.float32, None),
    "one_token": (2, 1, 2, 1, 16, True, False, None, (16, 16, 16, 16), jnp.float32, None),
    # ZAYA1's 8:2 heads, packed documents, head dim 24 (padded to 32 inside), mixed blocks
    "bf16_packed_docs": (2, 50, 8, 2, 24, True, True, None, (16, 32, 32, 16), jnp.bfloat16, None),
    # sliding windows with packed documents: narrower than a block, and spanning several
    "window_in_block_packed": (2, 70, 4, 2, 16, True, True, None, (16, 16, 16, 32), jnp.float32, 5),
    "window_over_blocks": (1, 90, 4, 2, 16, True, False, None, (32, 16, 16, 16), jnp.float32, 37),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_matches_reference(case):
    batch, seq, heads, kv_heads, dim, causal, segments, sm_scale, blocks, dtype, window = case
    q, k, v, do = _inputs(batch, seq, heads, kv_heads, dim, dtype)
    segment_ids = _packed_segments(batch, seq, seed=seq) if segments else None
    kernel = jax.jit(functools.partial(
        cca_flash_attention, segment_ids=segment_ids, causal=causal, sm_scale=sm_scale,
        block_q=blocks[0], block_k=blocks[1], block_q_bwd=blocks[2], block_k_bwd=blocks[3], window=window))
    reference = functools.partial(attention_reference, segment_ids=segment_ids, causal=causal,
                                  sm_scale=sm_scale, window=window)
    got = _value_and_grads(kernel, q, k, v, do)
    as_f32 = [x.astype(jnp.float32) for x in (q, k, v, do)]
    want = _value_and_grads(reference, *as_f32)
    atol, rtol = (2e-5, 2e-5) if dtype == jnp.float32 else (5e-2, 2e-2)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        assert g.dtype == dtype, name
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w), atol=atol,
                                   rtol=rtol, err_msg=name)


def test_windows_at_and_around_block_boundaries_match_reference():
    """Block skipping at the block edges, 16-row blocks: a query block's first visible key (its first
    row minus window - 1) is the first key of a key block (window 16 k + 1), the last (16 k + 2), or
    one past the row's own block (16 k), for k = 1, 2; out, dq, dk and dv under a random cotangent
    equal the reference. (Skipping one key block too many in the forward walk, or stopping the dk/dv
    walk one query block early, fails it at window 18: out and dk off in 3% of the entries.)"""
    q, k, v, do = _inputs(1, 64, 2, 1, 16, jnp.float32)
    for window in (16, 17, 18, 33, 34):
        kernel = jax.jit(functools.partial(cca_flash_attention, block_q=16, block_k=16, block_q_bwd=16,
                                           block_k_bwd=16, window=window))
        got = _value_and_grads(kernel, q, k, v, do)
        want = _value_and_grads(functools.partial(attention_reference, window=window), q, k, v, do)
        for name, g, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2e-5, rtol=2e-5,
                                       err_msg=f"{name}, window {window}")


def test_window_skips_blocks_before_it():
    """Window 8, blocks of 16: NaN values in key block 0 reach only the query blocks that visit it
    (0-1; block 2 starts at key 25), and NaN output gradients of query block 3 only the key blocks
    it visits (2-3); a kernel walking every causal block would spread both everywhere."""
    q, k, v, do = _inputs(1, 64, 2, 1, 16, jnp.float32)
    attend = functools.partial(cca_flash_attention, block_q=16, block_k=16, block_q_bwd=16, block_k_bwd=16,
                               window=8)
    out, vjp = jax.vjp(attend, q, k, v.at[:, :16].set(jnp.nan))
    assert np.isnan(out[:, 16:24]).all() and np.isfinite(out[:, 32:]).all()
    _, vjp = jax.vjp(attend, q, k, v)
    dq, dk, dv = vjp(do.at[:, 48:].set(jnp.nan))
    assert np.isfinite(dq[:, :48]).all() and np.isfinite(dk[:, :32]).all() and np.isfinite(dv[:, :32]).all()
    assert np.isnan(dv[:, 48:]).all()


# (offset, chunk length Sq, window, blocks fwd q/k + bwd q/k) of a query chunk in Sk = 80 keys
CHUNKS = {
    "middle": (32, 32, None, (16, 16, 16, 32)),
    "unaligned_tail": (37, 43, None, (16, 32, 32, 16)),
    "first": (0, 40, None, (16, 16, 16, 16)),
    "window_in_block": (24, 40, 5, (16, 16, 16, 32)),
    "window_over_blocks": (40, 40, 37, (32, 16, 16, 16)),
}


@pytest.mark.parametrize("case", CHUNKS.values(), ids=CHUNKS.keys())
def test_query_chunk_matches_rows_of_full_attention(case):
    """Queries [offset, offset + Sq) against all Sk keys (the offset traced, as inside shard_map)
    equal those rows of the reference over the whole sequence: values, dq of the chunk's rows, and
    dk, dv over all keys with the output gradient zero outside the chunk. Packed documents, one of
    them running from before the chunk into it."""
    offset, chunk, window, blocks = case
    q, k, v, do = _inputs(2, 80, 4, 2, 16, jnp.float32)
    segment_ids = _packed_segments(2, 80, seed=3).at[:, offset - 5 if offset else 0:offset + 3].set(99)
    rows = slice(offset, offset + chunk)
    kernel = jax.jit(lambda q, k, v, seg, off: cca_flash_attention(
        q, k, v, segment_ids=lax.dynamic_slice_in_dim(seg, off, chunk, 1), kv_segment_ids=seg, q_offset=off,
        window=window, block_q=blocks[0], block_k=blocks[1], block_q_bwd=blocks[2], block_k_bwd=blocks[3]))
    out, vjp = jax.vjp(lambda q, k, v: kernel(q, k, v, segment_ids, jnp.int32(offset)), q[:, rows], k, v)
    got = (out, *vjp(do[:, rows]))
    reference = functools.partial(attention_reference, segment_ids=segment_ids, window=window)
    full, vjp = jax.vjp(reference, q, k, v)
    dq, dk, dv = vjp(jnp.zeros_like(do).at[:, rows].set(do[:, rows]))
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, (full[:, rows], dq[:, rows], dk, dv), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2e-5, rtol=2e-5, err_msg=name)


def test_query_chunk_skips_blocks_outside_it():
    """Chunk [32, 64) of 96 keys, blocks of 16: NaN values in keys past the chunk's last query
    reach neither the output nor dq (the forward and dq walks stop at the chunk's diagonal), and
    NaN output gradients of chunk rows 32-47 reach no key of block 3 (48-63: the dkdv walk starts
    at the chunk's query block 1 there); with window 8 NaN values in key block 0 reach no query of
    the chunk. A walk over every block (masked) would spread the NaN to all of them."""
    q, k, v, do = _inputs(1, 96, 2, 1, 16, jnp.float32)
    attend = functools.partial(cca_flash_attention, block_q=16, block_k=16, block_q_bwd=16, block_k_bwd=16)
    chunk = functools.partial(attend, q_offset=jnp.int32(32))
    out, vjp = jax.vjp(chunk, q[:, 32:64], k, v.at[:, 64:].set(jnp.nan))
    dq, _, _ = vjp(do[:, 32:64])
    assert np.isfinite(out).all() and np.isfinite(dq).all()
    _, vjp = jax.vjp(chunk, q[:, 32:64], k, v)
    _, dk, dv = vjp(do[:, 32:64].at[:, :16].set(jnp.nan))
    assert np.isfinite(dk[:, 48:]).all() and np.isfinite(dv[:, 48:]).all() and np.isnan(dv[:, :48]).all()
    out = attend(q[:, 32:64], k, v.at[:, :16].set(jnp.nan), q_offset=jnp.int32(32), window=8)
    assert np.isfinite(out).all()


def test_segments_isolate_documents():
    """Changing one document's keys leaves the other documents' outputs unchanged."""
    q, k, v, _ = _inputs(1, 32, 2, 1, 16, jnp.float32)
    segment_ids = jnp.asarray([[0] * 10 + [1] * 12 + [2] * 10], jnp.int32)
    attend = functools.partial(cca_flash_attention, segment_ids=segment_ids, block_q=16,
                               block_k=16)
    before = attend(q, k, v)
    after = attend(q, k.at[:, 10:22].set(5.0), v.at[:, 10:22].set(-3.0))
    np.testing.assert_array_equal(before[:, :10], after[:, :10])
    np.testing.assert_array_equal(before[:, 22:], after[:, 22:])
    assert not np.allclose(before[:, 10:22], after[:, 10:22])


def test_rejects_bad_head_ratio():
    q, k, v, _ = _inputs(1, 8, 3, 2, 16, jnp.float32)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        cca_flash_attention(q, k, v)


def test_rejects_bad_query_chunk():
    q, k, v, _ = _inputs(1, 32, 2, 1, 16, jnp.float32)
    seg = jnp.zeros((1, 32), jnp.int32)
    with pytest.raises(ValueError, match="q_offset needs causal"):
        cca_flash_attention(q[:, :16], k, v, q_offset=16, causal=False)
    with pytest.raises(ValueError, match="kv_segment_ids exactly when"):  # the queries' segment ids alone
        cca_flash_attention(q[:, :16], k, v, segment_ids=seg[:, :16], q_offset=16)
    with pytest.raises(ValueError, match="kv_segment_ids are for a query chunk"):
        cca_flash_attention(q, k, v, segment_ids=seg, kv_segment_ids=seg)
    with pytest.raises(ValueError, match="matching q"):  # a longer key sequence needs an offset
        cca_flash_attention(q[:, :16], k, v)


@pytest.mark.parametrize("platform,window", [("cuda", None), ("rocm", None), ("cuda", 64)])
def test_lowers_to_triton(platform, window):
    """Forward and backward kernels lower with the Pallas Triton backend (no GPU needed)."""
    spec = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.bfloat16)

    def loss(q, k, v, segment_ids):
        out = cca_flash_attention(q, k, v, segment_ids=segment_ids, interpret=False, window=window)
        return out.astype(jnp.float32).sum()

    text = lower_for_gpu(platform, jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))),
                         spec((1, 300, 8, 128)), spec((1, 300, 2, 128)), spec((1, 300, 2, 128)),
                         jax.ShapeDtypeStruct((1, 300), jnp.int32)).as_text()
    for name in ("cca_flash_attention_fwd", "cca_flash_attention_dq", "cca_flash_attention_dkdv"):
        assert f'name = "{name}"' in text


@pytest.mark.parametrize("platform", ["cuda", "rocm"])
def test_query_chunk_lowers_to_triton(platform):
    """The query-chunk kernels (a traced offset as a [1] int32 input) lower for both GPU targets."""
    spec = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.bfloat16)
    ids = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.int32)

    def loss(q, k, v, segment_ids, kv_segment_ids, offset):
        out = cca_flash_attention(q, k, v, segment_ids=segment_ids, kv_segment_ids=kv_segment_ids,
                                  q_offset=offset, interpret=False)
        return out.astype(jnp.float32).sum()

    text = lower_for_gpu(platform, jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))),
                         spec((1, 256, 8, 128)), spec((1, 512, 2, 128)), spec((1, 512, 2, 128)),
                         ids((1, 256)), ids((1, 512)), ids(())).as_text()
    for name in ("cca_flash_attention_fwd", "cca_flash_attention_dq", "cca_flash_attention_dkdv"):
        assert f'name = "{name}"' in text
