"""The train step with Pallas attention and context parallelism lowers for CUDA and ROCm.

With mesh.context = 2 each context rank runs the flash kernels on its query chunk against the
all-gathered keys (zaya_jax.parallel.attention_sharding). Lowered like tests/test_gpu_lowering.py
(from this CPU-only machine, nothing compiles): every Triton custom call sits inside a manual
(shard_map) region, the attention kernels are called as often as without context parallelism
(one forward, dq and dkdv per layer body; the same offset-taking kernel on every rank), and the
layer body gathers the keys, values and key segment ids (3 all-gathers) and reduce-scatters dk
and dv (2), which the step without context parallelism does not.
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
    assert set(counts) == ATTENTION_KERNELS and counts == reference, (counts, reference)
    for op, n in (("stablehlo.all_gather", 3), ("stablehlo.reduce_scatter", 2)):
        assert (text.count(op), reference_text.count(op)) == (n, 0), op
