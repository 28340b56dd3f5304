"""Zigzag context parallelism balances the flash kernel's work over the context ranks.

Counted with the kernel's own block walks (pallas_kernels.flash_attention `_kv_loops` for the
forward and dq kernels, `_q_loops` for dk/dv) at the offsets each rank's queries have: with
contiguous chunks rank c walks about c + 1/2 chunks of key blocks (the last rank 6.6x the first
at C = 4), with the zigzag halves (zaya_jax.parallel.attention_sharding.zigzag_halves) every rank
walks the same number.
"""

import dataclasses

import jax.numpy as jnp

from pallas_kernels.flash_attention import _Config, _kv_loops, _q_loops
from zaya_jax.parallel.attention_sharding import zigzag_halves

S, C, BLOCK = 8192, 4, 128
CFG = _Config(sm_scale=1.0, causal=True, window=None, seq_len=S, block_q=BLOCK, block_k=BLOCK, block_q_bwd=BLOCK,
              block_k_bwd=BLOCK, num_stages=1, num_warps=4, num_stages_bwd=1, num_warps_bwd=4, interpret=True)


def blocks_walked(offset: int, length: int) -> tuple[int, int]:
    """(key blocks the forward walks over all query blocks, query blocks the dk/dv kernel walks
    over all key blocks) for the `length` queries at `offset` against S keys."""
    cfg = dataclasses.replace(CFG, seq_len=length)
    offset = jnp.int32(offset)
    forward = sum(int(stop - start) for i in range(length // BLOCK)
                  for start, stop, _ in _kv_loops(i, cfg, S // BLOCK, offset))
    dkdv = sum(int(stop - start) for j in range(S // BLOCK) for start, stop, _ in _q_loops(j, cfg, offset))
    return forward, dkdv


def test_zigzag_halves_walk_equal_work_on_every_rank():
    chunk, half = S // C, S // (2 * C)
    contiguous = [blocks_walked(c * chunk, chunk) for c in range(C)]
    zigzag = [tuple(map(sum, zip(*(blocks_walked(h * half, half) for h in zigzag_halves(c, C))))) for c in range(C)]
    assert contiguous == [(136, 136), (392, 392), (648, 648), (904, 904)]
    assert zigzag == [(520, 520)] * C
    assert sum(map(sum, zigzag)) == sum(map(sum, contiguous))  # the same total, spread evenly
