"""Block sizes, pipeline stages and warps per GPU platform, and the shared memory they take.

A Triton kernel's static shared memory (LDS on AMD) is, to a good estimate, its software
pipeline: `num_stages` copies of every operand tile loaded inside the k loop, plus the tiles a
program holds for its whole life. A kernel that needs more than the device has per block does
not launch. Budgets per block:
  cuda  H100 / H200: 228 KiB per SM (227 KiB usable by one block)
  rocm  MI300X: 64 KiB of LDS per CU
The tables below hold one entry per platform and operand size (bf16, fp32) such that every
kernel fits at ZAYA1's head dim (128); tests/test_kernel_blocks.py computes the footprints.

Attention (flash_attention.py), per kernel, with H the (padded) head dim:
  fwd   holds q [block_q, H]; pipelines k, v [block_k, H]
  dq    holds q, do [block_q_bwd, H]; pipelines k, v [block_k_bwd, H]
  dkdv  holds k, v [block_k_bwd, H]; pipelines q, do [block_q_bwd, H]
and the fp32 tiles one program keeps in registers:
  fwd   the output accumulator [block_q, H] and the score tile [block_q, block_k]
  dq    the dq accumulator [block_q_bwd, H] and two score tiles (p, dp) [block_q_bwd, block_k_bwd]
  dkdv  the dk and dv accumulators [block_k_bwd, H] and two score tiles (p, dp) [block_k_bwd, block_q_bwd]
Grouped matmul (grouped_matmul.py), tiles (tm, tk, tn):
  gmm      pipelines lhs [tm, tk] and rhs [tk, tn]; its backward gmm swaps tk and tn
  gmm_x2   pipelines lhs [tm, tk] and two rhs [tk, tn] (gate and up); its backward gmm runs the
           two pairs' k loops one after another, one pair's footprint
  tgmm     pipelines lhs [tm, tk] and grad [tm, tn]
Warps per block (`num_warps`, for attention one for the forward kernel and one for the two
backward kernels; a warp is 32 threads on NVIDIA, a wavefront of 64 on AMD) are chosen so that,
with the blocks per SM (CU) its shared memory leaves room for, every kernel keeps at least
MIN_RESIDENT_WARPS warps resident (one block of 4 warps per SM, as the grouped matmul's d lhs and
tgmm kernels ran at 144 KiB, leaves the SM idle while it waits on memory), and its fp32
accumulators and score tiles take at most half the registers a thread may have
(ACCUMULATOR_REGISTERS), leaving the other half to operand fragments and addresses. Chosen by
these rules, not timed on a GPU.
"""

from __future__ import annotations

import dataclasses

KIB = 1024
SHARED_MEMORY_BYTES = {"cuda": 227 * KIB, "rocm": 64 * KIB}
WARP_THREADS = {"cuda": 32, "rocm": 64}
# half of the registers one thread may have (NVIDIA: 255; AMD CDNA3: 512 VGPRs, AGPRs included)
ACCUMULATOR_REGISTERS = {"cuda": 128, "rocm": 256}
MIN_RESIDENT_WARPS = 8


@dataclasses.dataclass(frozen=True)
class AttentionBlocks:
    block_q: int
    block_k: int
    block_q_bwd: int
    block_k_bwd: int
    num_stages: int  # forward kernel
    num_warps: int
    num_stages_bwd: int  # dq and dkdv kernels
    num_warps_bwd: int


@dataclasses.dataclass(frozen=True)
class MatmulBlocks:
    tiling: tuple[int, int, int]  # (tm, tk, tn)
    num_stages: int
    num_warps: int


# Keyed by (platform, operand itemsize). cuda: the sizes the kernels were written for (a 3-stage
# GEMM pipeline as on Hopper; 2 stages for fp32 operands). rocm: smaller tiles, 2 stages, and
# smaller still for fp32 operands, to stay within 64 KiB of LDS. Every grouped-matmul kernel
# takes over half the shared memory (one block per SM / CU), hence 8 warps everywhere. Attention:
# on cuda the dk/dv kernel's accumulators and score tiles (24576 fp32) need 8 warps to fit 128
# registers a thread (192 at 4), the forward's as well (96 at 8, 192 at 4), and fp32 operands
# leave one block (8 warps) per SM; on rocm every kernel takes 48 KiB of the 64 KiB (one block
# per CU), so 8 wavefronts are what keeps 8 resident.
ATTENTION_BLOCKS = {
    ("cuda", 2): AttentionBlocks(block_q=128, block_k=64, block_q_bwd=64, block_k_bwd=64, num_stages=2,
                                 num_warps=8, num_stages_bwd=2, num_warps_bwd=8),
    ("cuda", 4): AttentionBlocks(block_q=128, block_k=64, block_q_bwd=64, block_k_bwd=64, num_stages=2,
                                 num_warps=8, num_stages_bwd=2, num_warps_bwd=8),
    ("rocm", 2): AttentionBlocks(block_q=64, block_k=32, block_q_bwd=32, block_k_bwd=32, num_stages=2,
                                 num_warps=8, num_stages_bwd=2, num_warps_bwd=8),
    ("rocm", 4): AttentionBlocks(block_q=32, block_k=16, block_q_bwd=16, block_k_bwd=16, num_stages=2,
                                 num_warps=8, num_stages_bwd=2, num_warps_bwd=8),
}
MATMUL_BLOCKS = {
    ("cuda", 2): MatmulBlocks(tiling=(128, 64, 128), num_stages=3, num_warps=8),
    ("cuda", 4): MatmulBlocks(tiling=(128, 64, 128), num_stages=2, num_warps=8),
    ("rocm", 2): MatmulBlocks(tiling=(128, 32, 64), num_stages=2, num_warps=8),
    ("rocm", 4): MatmulBlocks(tiling=(64, 32, 64), num_stages=2, num_warps=8),
}
INTERPRET_PLATFORM = "cuda"  # interpret mode (CPU) runs the cuda sizes: the numerics tests cover them


def _key(platform: str, itemsize: int) -> tuple[str, int]:
    return (platform if platform in SHARED_MEMORY_BYTES else INTERPRET_PLATFORM, 2 if itemsize <= 2 else 4)


def attention_blocks(platform: str, itemsize: int) -> AttentionBlocks:
    """The blocks for `platform` ("cuda", "rocm"; anything else: interpret mode) and operand size."""
    return ATTENTION_BLOCKS[_key(platform, itemsize)]


def matmul_blocks(platform: str, itemsize: int) -> MatmulBlocks:
    return MATMUL_BLOCKS[_key(platform, itemsize)]


def attention_footprints(b: AttentionBlocks, head_dim: int, itemsize: int) -> dict[str, int]:
    """Static shared-memory bytes of the three attention kernels."""
    fwd = (b.block_q + b.num_stages * 2 * b.block_k) * head_dim * itemsize
    dq = (2 * b.block_q_bwd + b.num_stages_bwd * 2 * b.block_k_bwd) * head_dim * itemsize
    dkdv = (2 * b.block_k_bwd + b.num_stages_bwd * 2 * b.block_q_bwd) * head_dim * itemsize
    return {"fwd": fwd, "dq": dq, "dkdv": dkdv}


def matmul_footprints(b: MatmulBlocks, itemsize: int) -> dict[str, int]:
    """Static shared-memory bytes of gmm, gmm_x2, their transposed-rhs backward and tgmm."""
    tm, tk, tn = b.tiling
    return {"gmm": b.num_stages * (tm * tk + tk * tn) * itemsize,
            "gmm_x2": b.num_stages * (tm * tk + 2 * tk * tn) * itemsize,
            "gmm_transposed_rhs": b.num_stages * (tm * tn + tn * tk) * itemsize,
            "tgmm": b.num_stages * (tm * tk + tm * tn) * itemsize}


def matmul_accumulators(b: MatmulBlocks) -> dict[str, int]:
    """fp32 accumulator elements one program of each grouped-matmul kernel holds."""
    tm, tk, tn = b.tiling
    return {"gmm": tm * tn, "gmm_x2": 2 * tm * tn, "gmm_transposed_rhs": tm * tk, "tgmm": tk * tn}


def attention_accumulators(b: AttentionBlocks, head_dim: int) -> dict[str, int]:
    """fp32 elements one program of each attention kernel holds: accumulators and score tiles."""
    bq, bk = b.block_q_bwd, b.block_k_bwd
    return {"fwd": b.block_q * head_dim + b.block_q * b.block_k,
            "dq": bq * head_dim + 2 * bq * bk,
            "dkdv": 2 * bk * head_dim + 2 * bk * bq}


def _occupancy(platform: str, footprints: dict[str, int], accumulators: dict[str, int],
               warps: dict[str, int]) -> dict[str, tuple[int, int]]:
    """Per kernel: (warps resident per SM / CU, given the blocks its shared memory allows; fp32
    accumulator registers per thread)."""
    return {name: (SHARED_MEMORY_BYTES[platform] // footprints[name] * warps[name],
                   -(-acc // (warps[name] * WARP_THREADS[platform])))
            for name, acc in accumulators.items()}


def matmul_occupancy(b: MatmulBlocks, platform: str, itemsize: int) -> dict[str, tuple[int, int]]:
    """`_occupancy` of the grouped-matmul kernels (all run `b.num_warps`)."""
    accumulators = matmul_accumulators(b)
    return _occupancy(platform, matmul_footprints(b, itemsize), accumulators, dict.fromkeys(accumulators, b.num_warps))


def attention_occupancy(b: AttentionBlocks, head_dim: int, platform: str, itemsize: int) -> dict[str, tuple[int, int]]:
    """`_occupancy` of the attention kernels (forward: `b.num_warps`, dq and dkdv: `b.num_warps_bwd`)."""
    return _occupancy(platform, attention_footprints(b, head_dim, itemsize), attention_accumulators(b, head_dim),
                      {"fwd": b.num_warps, "dq": b.num_warps_bwd, "dkdv": b.num_warps_bwd})
