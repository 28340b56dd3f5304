"""Every kernel's static shared memory fits its GPU, for every platform's block table.

Footprints come from `pallas_kernels.platform_blocks` (operand tiles x pipeline stages plus the
held tiles); the budgets are the devices' (H100/H200: 227 KiB per block, MI300X: 64 KiB LDS).
The warps of every kernel (attention forward, dq, dk/dv; grouped matmuls) keep enough warps
resident per SM / CU and their fp32 accumulators (and attention's score tiles) within half a
thread's registers. The kernels really use the table: every kernel traced for a platform carries
that platform's stages and warps.
"""

import dataclasses
import re


import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import cca_flash_attention, grouped_matmul, grouped_matmuls, lower_for_gpu
from pallas_kernels.platform_blocks import (ACCUMULATOR_REGISTERS, ATTENTION_BLOCKS, MATMUL_BLOCKS, MIN_RESIDENT_WARPS,
                                            SHARED_MEMORY_BYTES, attention_blocks, attention_footprints,
                                            attention_occupancy, matmul_blocks, matmul_footprints, matmul_occupancy)

ZAYA1_HEAD_DIM = 128


@pytest.mark.parametrize("platform,itemsize", sorted(ATTENTION_BLOCKS))
def test_attention_blocks_fit(platform, itemsize):
    footprints = attention_footprints(attention_blocks(platform, itemsize), ZAYA1_HEAD_DIM, itemsize)
    assert max(footprints.values()) <= SHARED_MEMORY_BYTES[platform], footprints


@pytest.mark.parametrize("platform,itemsize", sorted(MATMUL_BLOCKS))
def test_matmul_blocks_fit(platform, itemsize):
    """gmm_x2 (gate and up in one call) included: 144 KiB at the cuda bf16 blocks, 32 KiB at rocm's."""
    footprints = matmul_footprints(matmul_blocks(platform, itemsize), itemsize)
    assert max(footprints.values()) <= SHARED_MEMORY_BYTES[platform], footprints


def _assert_busy_within_registers(occupancy, platform):
    assert min(warps for warps, _ in occupancy.values()) >= MIN_RESIDENT_WARPS, occupancy
    assert max(registers for _, registers in occupancy.values()) <= ACCUMULATOR_REGISTERS[platform], occupancy


@pytest.mark.parametrize("platform,itemsize", sorted(ATTENTION_BLOCKS))
def test_attention_warps_keep_the_device_busy_within_registers(platform, itemsize):
    _assert_busy_within_registers(
        attention_occupancy(attention_blocks(platform, itemsize), ZAYA1_HEAD_DIM, platform, itemsize), platform)


@pytest.mark.parametrize("platform,itemsize", sorted(MATMUL_BLOCKS))
def test_matmul_warps_keep_the_device_busy_within_registers(platform, itemsize):
    _assert_busy_within_registers(matmul_occupancy(matmul_blocks(platform, itemsize), platform, itemsize), platform)


def test_the_issue_configuration_would_not_fit_mi300x():
    """The old grouped-matmul setting (tiles 128x64x128, 3 stages: 32 KiB a stage) exceeds 64 KiB."""
    old = dataclasses.replace(matmul_blocks("cuda", 2), num_stages=3)
    assert matmul_footprints(old, 2)["gmm"] == 96 * 1024 > SHARED_MEMORY_BYTES["rocm"]


def test_the_issue_warps_would_leave_the_sm_idle():
    """4 warps (as d lhs and tgmm ran) at 144 KiB: one block of 4 warps per SM, under the minimum;
    and gate+up's two 128x128 accumulators on 4 warps would take 256 registers a thread."""
    occupancy = matmul_occupancy(dataclasses.replace(matmul_blocks("cuda", 2), num_warps=4), "cuda", 2)
    assert occupancy["tgmm"][0] == occupancy["gmm_transposed_rhs"][0] == 4 < MIN_RESIDENT_WARPS
    assert occupancy["gmm_x2"][1] == 256 > ACCUMULATOR_REGISTERS["cuda"]


def test_the_old_attention_warps_and_more_stages_would_not_fit():
    """4 warps in the backward kernels (as they ran): dk/dv's two [64, 128] accumulators and two
    [64, 64] score tiles take 192 registers a thread, and fp32 operands (one 192 KiB block per SM)
    keep only 4 warps resident; 4 in the forward on rocm (as it ran) leaves 4 wavefronts per CU.
    A third stage takes fp32 attention on cuda to 256 KiB, a fourth bf16 on rocm to 80 KiB."""
    old = dataclasses.replace(attention_blocks("cuda", 2), num_warps_bwd=4)
    assert attention_occupancy(old, ZAYA1_HEAD_DIM, "cuda", 2)["dkdv"][1] == 192 > ACCUMULATOR_REGISTERS["cuda"]
    old = dataclasses.replace(attention_blocks("cuda", 4), num_warps_bwd=4)
    assert attention_occupancy(old, ZAYA1_HEAD_DIM, "cuda", 4)["dq"][0] == 4 < MIN_RESIDENT_WARPS
    old = dataclasses.replace(attention_blocks("rocm", 2), num_warps=4)
    assert attention_occupancy(old, ZAYA1_HEAD_DIM, "rocm", 2)["fwd"][0] == 4 < MIN_RESIDENT_WARPS
    more = dataclasses.replace(attention_blocks("cuda", 4), num_stages=3)
    assert attention_footprints(more, ZAYA1_HEAD_DIM, 4)["fwd"] == 256 * 1024 > SHARED_MEMORY_BYTES["cuda"]
    more = dataclasses.replace(attention_blocks("rocm", 2), num_stages_bwd=4)
    assert attention_footprints(more, ZAYA1_HEAD_DIM, 2)["dkdv"] == 80 * 1024 > SHARED_MEMORY_BYTES["rocm"]


def _stages_and_warps(text: str, prefix: str) -> dict[str, tuple[int, int]]:
    """{kernel name past `prefix`: (num_stages, num_warps)} of the Triton custom calls in `text`."""
    calls = {}
    for line in text.splitlines():
        name = re.search(rf'name = "{prefix}(\w+)"', line)
        if name:
            calls[name.group(1)] = tuple(int(re.search(rf"{key} = (\d+)", line).group(1))
                                         for key in ("num_stages", "num_warps"))
    return calls


@pytest.mark.parametrize("platform", ["cuda", "rocm"])
def test_lowered_kernels_use_the_platform_blocks(platform):
    spec = jax.ShapeDtypeStruct
    def attention_loss(q, k, v):  # forward, dq and dkdv
        return cca_flash_attention(q, k, v).astype(jnp.float32).sum()
    attention = lower_for_gpu(platform, jax.jit(jax.value_and_grad(attention_loss, argnums=(0, 1, 2))),
                              spec((1, 256, 8, 128), jnp.bfloat16), spec((1, 256, 2, 128), jnp.bfloat16),
                              spec((1, 256, 2, 128), jnp.bfloat16)).as_text()
    def gmm_loss(x, w, sizes):  # forward, d lhs and tgmm
        return grouped_matmul(x, w, sizes).astype(jnp.float32).sum()
    gmm = lower_for_gpu(platform, jax.jit(jax.value_and_grad(gmm_loss, argnums=(0, 1))), spec((512, 256), jnp.bfloat16),
                        spec((4, 256, 256), jnp.bfloat16), spec((4,), jnp.int32)).as_text()
    blocks, tiles = attention_blocks(platform, 2), matmul_blocks(platform, 2)
    assert _stages_and_warps(attention, "cca_flash_attention_") == {
        "fwd": (blocks.num_stages, blocks.num_warps), "dq": (blocks.num_stages_bwd, blocks.num_warps_bwd),
        "dkdv": (blocks.num_stages_bwd, blocks.num_warps_bwd)}
    assert f"grid_x = {256 // blocks.block_q}" in attention   # query blocks of the forward kernel
    assert f"num_stages = {tiles.num_stages}" in gmm
    assert set(re.findall(r"num_warps = (\d+)", gmm)) == {str(tiles.num_warps)}  # all three kernels
    assert f"grid_x = {512 // tiles.tiling[0]}" in gmm         # row tiles
    gate_up = lower_for_gpu(platform, jax.jit(lambda x, g, u, s: grouped_matmuls(x, (g, u), s)),
                            spec((512, 256), jnp.bfloat16), spec((4, 256, 256), jnp.bfloat16),
                            spec((4, 256, 256), jnp.bfloat16), spec((4,), jnp.int32)).as_text()
    assert 'name = "gmm_x2"' in gate_up and f"num_stages = {tiles.num_stages}" in gate_up
