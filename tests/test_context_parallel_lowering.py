"""The train step with Pallas attention and context parallelism lowers for CUDA and ROCm.

With mesh.context = 2 each context rank runs the flash kernels on its zigzag query halves
against the all-gathered keys (zaya_jax.parallel.attention_sharding). Lowered like
tests/test_gpu_lowering.py (from this CPU-only machine, nothing compiles): every Triton custom
call sits inside a manual (shard_map) region; each layer body calls every flash kernel twice as
often as without context parallelism (one call per query half; the forward kernel's custom call
sits in one lowered function, the jitted `_forward`, called twice); it gathers the
keys, values and key segment ids (3 all-gathers), reduce-scatters dk and dv (2), and permutes
the two query halves there and their outputs back, forward and backward (8 collective
permutes), none of which the step without context parallelism has.
"""

import collections

import pytest

from tests.test_gpu_lowering import ATTENTION_KERNELS, CONFIGS, lowered_train_step, triton_calls

LAYOUTS = {"pallas_context": "data=4,context=2", "pallas_no_context": "data=8"}


def attention_calls(layout: str, platform: str) -> tuple[collections.Counter, str]:
    """({attention kernel: Triton calls}, module text) of the train step on `layout`; every
    Triton call (attention and grouped matmul) must be inside shard_map."""
    CONFIGS[layout] = ({"attention_kernel": "pallas"}, LAYOUTS[layout], "adamw")
    try:
        module = lowered_train_step(layout, platform)
    finally:
        del CONFIGS[layout]
    calls = triton_calls(module)
    assert all(manual for _, manual in calls), [kernel for kernel, manual in calls if not manual]
    return collections.Counter(kernel for kernel, _ in calls if kernel in ATTENTION_KERNELS), str(module)


@pytest.mark.parametrize("platform", ["cuda", "rocm"])
def test_context_parallel_train_step_lowers_with_flash_kernels_inside_shard_map(platform):
    counts, text = attention_calls("pallas_context", platform)
    reference, reference_text = attention_calls("pallas_no_context", platform)
    assert set(counts) == set(reference) == ATTENTION_KERNELS, (counts, reference)
    for kernel in ("cca_flash_attention_dq", "cca_flash_attention_dkdv"):
        assert counts[kernel] == 2 * reference[kernel], (kernel, counts, reference)
    assert text.count("call @_forward(") == 2 * reference_text.count("call @_forward(") > 0
    for op, n in (("stablehlo.all_gather", 3), ("stablehlo.reduce_scatter", 2), ("stablehlo.collective_permute", 8)):
        assert (text.count(op), reference_text.count(op)) == (n, 0), op
