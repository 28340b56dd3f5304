"""Pallas kernels for the hot paths, each beside its pure-JAX reference.

- `cca_flash_attention` (reference `attention_reference`): causal GQA flash attention with
  segment ids for packed documents, sliding windows, and query chunks at a (traced) sequence
  offset against all the keys (context parallelism); forward and backward kernels.
- `grouped_matmul` (reference `grouped_matmul_reference`, i.e. `jax.lax.ragged_dot`) and
  `transposed_grouped_matmul` (reference `transposed_grouped_matmul_reference`): the MoE expert
  matmul and its weight gradient; `grouped_matmuls`, several right-hand sides of one lhs in one
  kernel (the MoE's gate and up projections).
Block sizes and pipeline stages are per platform (`platform_blocks`); `building_for("cuda" |
"rocm")` builds the GPU kernels from a CPU process, and `lower_for_gpu` lowers a jitted function
with them for that platform's GPU, without one.
"""

from pallas_kernels._backend import building_for, lower_for_gpu
from pallas_kernels.attention_reference import attention_reference
from pallas_kernels.flash_attention import cca_flash_attention
from pallas_kernels.grouped_matmul import grouped_matmul, grouped_matmuls, transposed_grouped_matmul
from pallas_kernels.grouped_matmul_reference import (grouped_matmul_reference,
                                                     transposed_grouped_matmul_reference)

__all__ = [
    "attention_reference",
    "building_for",
    "cca_flash_attention",
    "grouped_matmul",
    "grouped_matmul_reference",
    "grouped_matmuls",
    "lower_for_gpu",
    "transposed_grouped_matmul",
    "transposed_grouped_matmul_reference",
]
