"""The complete train step lowers for CUDA and ROCm from this CPU-only machine.

For every GPU configuration the docs promise, the jitted train step (forward, backward,
optimizer) of a tiny model on an 8-device mesh is traced with the GPU kernels and lowered for
the platform's GPU (`pallas_kernels.lower_for_gpu`): the Pallas Triton lowering runs here and
raises what it would raise on a GPU (bad block shapes, unsupported ops). In the lowered
StableHLO every Triton custom call must sit inside a manual region (`sdy.manual_computation`,
i.e. jax.shard_map): outside one, XLA's partitioner would gather the kernel's global operands
onto every device. Lowering only; nothing compiles. The DPO step (its
frozen reference model's forward too) is lowered for one configuration, and the launch config
itself (configs/zaya1_base.py at its real widths, two layers) for both platforms.
"""

import collections
import functools
import re

import jax
import pytest
from jax._src.interpreters import mlir as jax_mlir
from jaxlib.mlir import ir

from pallas_kernels import lower_for_gpu
from zaya_jax.config_files import load_config_file
from zaya_jax.parallel.mesh import make_mesh, parse_mesh_flag
from zaya_jax.train.program import abstract_batch, build_program
from zaya_jax.train.settings import settings_from_config
from zaya_jax.parallel.rules import with_shardings

TRITON = "__gpu$xla.gpu.triton"
MANUAL = "sdy.manual_computation"
# the expert matmuls: gate and up in one gmm_x2 call and its summing input gradient, down in gmm
GMM_KERNELS = {"gmm_x2", "gmm", "gmm_transposed_rhs_x2", "gmm_transposed_rhs", "tgmm"}
ATTENTION_KERNELS = {"cca_flash_attention_fwd", "cca_flash_attention_dq", "cca_flash_attention_dkdv"}

# name: (model overrides, mesh, optimizer). Together they cover the GPU configurations of
# docs/parallel.md: Pallas attention with the default (Pallas) grouped matmul under FSDP and tensor
# parallelism; ragged_dot (XLA) with context parallelism; ragged_all_to_all expert parallelism; the
# launch's kernels (configs/zaya1_base.py: XLA attention, Pallas grouped matmul) on its mesh shape.
CONFIGS = {
    "pallas_fsdp_tensor": ({"attention_kernel": "pallas"}, "data=2,fsdp=2,tensor=2", "muon"),
    "ragged_xla_context": ({"moe_backend": "ragged", "moe_matmul_kernel": "xla"}, "data=4,context=2", "adamw"),
    "ragged_all_to_all": ({"expert_parallel": "ragged_all_to_all", "attention_kernel": "pallas"},
                          "data=2,expert=4", "adamw"),
    "launch_xla_attention_context": ({}, "data=4,context=2", "muon"),
    # a sliding and a full layer: the layer's lax.cond holds a windowed and a full kernel call
    "pallas_sliding_window": ({"attention_kernel": "pallas", "layer_types": ("hybrid_sliding", "hybrid"),
                               "sliding_window": 16}, "data=2,fsdp=2,tensor=2", "adamw"),
}


def triton_calls(module: ir.Module) -> list[tuple[str, bool]]:
    """[(kernel name, inside a manual region)] for every Triton custom call of the module.

    A call inside a private function counts as inside when every call site of that function is."""
    calls, sites, functions = [], {}, {}

    def walk(op, function: str, manual: bool):
        for region in op.regions:
            for block in region.blocks:
                for child in block.operations:
                    child = child.operation
                    attrs = child.attributes
                    if child.name == "func.func":
                        name = ir.StringAttr(attrs["sym_name"]).value
                        functions[name] = child
                        walk(child, name, False)
                        continue
                    if child.name == "func.call":
                        sites.setdefault(ir.FlatSymbolRefAttr(attrs["callee"]).value, []).append((function, manual))
                    if child.name == "stablehlo.custom_call" and ir.StringAttr(attrs["call_target_name"]).value == TRITON:
                        kernel = ir.StringAttr(ir.DictAttr(attrs["mhlo.backend_config"])["name"]).value
                        calls.append((kernel, function, manual))
                    walk(child, function, manual or child.name == MANUAL)

    walk(module.operation, "", False)

    def inside(function: str, seen=()) -> bool:
        callers = sites.get(function, [])
        return bool(callers) and all(m or (f not in seen and inside(f, seen + (f,))) for f, m in callers)
    return [(kernel, manual or inside(function)) for kernel, function, manual in calls]


def lowered_train_step(name: str, platform: str, objective: str = "lm") -> ir.Module:
    overrides, mesh_flag, optimizer = CONFIGS[name]
    config = load_config_file("configs/tiny.py")
    config.model.update(overrides)
    config.optimizer.name = optimizer
    config.train.objective = objective
    return lower_config(config, make_mesh(parse_mesh_flag(mesh_flag)), platform)


def lower_config(config, mesh, platform: str) -> ir.Module:
    """The train step of `config` on `mesh`, lowered for `platform` from abstract shapes only."""
    settings = settings_from_config(config)
    program = build_program(settings, mesh)
    state = with_shardings(program.abstract_state, program.shardings)
    batch = abstract_batch(settings.train.global_batch_size, settings.train.seq_len)
    text = lower_for_gpu(platform, program.train_step, state, batch, settings.model.rope_theta, mesh=mesh).as_text()
    return ir.Module.parse(text, context=jax_mlir.make_ir_context())


@pytest.mark.parametrize("platform", ["cuda", "rocm"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_train_step_lowers_with_kernels_inside_shard_map(name, platform):
    module = lowered_train_step(name, platform)
    calls = triton_calls(module)
    kernels = {kernel for kernel, _ in calls}
    overrides = CONFIGS[name][0]
    assert all(manual for _, manual in calls), [k for k, manual in calls if not manual]
    assert (ATTENTION_KERNELS <= kernels) == (overrides.get("attention_kernel") == "pallas"), kernels
    text = str(module)
    if overrides.get("moe_matmul_kernel") == "xla":
        assert not kernels & GMM_KERNELS and "ragged_dot" in text
    else:  # the GPU default: the Pallas grouped matmul, forward and both gradients; no ragged_dot
        assert GMM_KERNELS <= kernels and "ragged_dot" not in text, kernels
    if name == "ragged_all_to_all":
        assert "ragged_all_to_all" in text
    if "layer_types" in overrides:  # both branches of the layer's cond: the windowed and the full kernels
        assert sorted(k for k, _ in calls if k in ATTENTION_KERNELS) == sorted([*ATTENTION_KERNELS] * 2)


@pytest.mark.parametrize("platform", ["cuda", "rocm"])
def test_dpo_step_lowers_with_the_reference_forward_inside_shard_map(platform):
    """A DPO step (train.objective=dpo) adds the frozen reference model's forward: the forward
    kernels are called twice as often as in the LM step of the same config (the policy's forward
    and the reference's), the backward kernels as often; every call inside a manual region."""
    counts = {}
    for objective in ("lm", "dpo"):
        calls = triton_calls(lowered_train_step("pallas_fsdp_tensor", platform, objective))
        assert all(manual for _, manual in calls), [k for k, manual in calls if not manual]
        counts[objective] = collections.Counter(kernel for kernel, _ in calls)
    for kernel in ("cca_flash_attention_fwd", "gmm_x2", "gmm"):
        assert counts["dpo"][kernel] == 2 * counts["lm"][kernel] > 0, (kernel, counts)
    for kernel in ("cca_flash_attention_dq", "cca_flash_attention_dkdv", "gmm_transposed_rhs_x2", "gmm_transposed_rhs",
                   "tgmm"):
        assert counts["dpo"][kernel] == counts["lm"][kernel] > 0, (kernel, counts)


def test_kernel_saving_remat_runs_each_forward_kernel_once():
    """Under `dots_no_batch` remat the backward pass runs the flash forward and the grouped matmul
    forward again (their outputs are not dots without batch dimensions); `dots_no_batch_and_kernels`
    saves their named outputs (the flash output and logsumexp, the expert matmul outputs), so each
    forward kernel is called once per layer body, the backward kernels as often as before."""
    counts = {}
    for remat in ("dots_no_batch", "dots_no_batch_and_kernels"):
        CONFIGS["remat_probe"] = ({"attention_kernel": "pallas", "remat": remat}, "data=2,fsdp=2,tensor=2", "adamw")
        try:
            calls = triton_calls(lowered_train_step("remat_probe", "cuda"))
        finally:
            del CONFIGS["remat_probe"]
        counts[remat] = collections.Counter(kernel for kernel, _ in calls)
    saved, recomputed = counts["dots_no_batch_and_kernels"], counts["dots_no_batch"]
    for kernel in ("cca_flash_attention_fwd", "gmm_x2", "gmm"):
        assert recomputed[kernel] == 2 * saved[kernel] > 0, (kernel, counts)
    for kernel in ("cca_flash_attention_dq", "cca_flash_attention_dkdv", "gmm_transposed_rhs_x2", "gmm_transposed_rhs",
                   "tgmm"):
        assert recomputed[kernel] == saved[kernel] > 0, (kernel, counts)


# configs/zaya1_base.py at its real widths and vocabulary (hidden 2048, head_dim 128, 8 query / 2
# KV heads, 16 experts of width 2048, router hidden 256, V = 262,272), bf16, its remat policy and
# `auto` kernels, on its own mesh (data=-1, context=2: data=4 on 8 devices), with 2 layers and a
# 4 x 320 batch: 160 tokens per device, a count no width of the model shares, so an expert
# temporary over all tokens is recognisable by its shape. The batch carries segment ids as an
# input of the step: every packing of documents lowers to this one module.
BASE_LAYERS, BASE_BATCH, BASE_SEQ = 2, 4, 320


BASE_EXPERTS = load_config_file("configs/zaya1_base.py").model.num_experts


def lowered_base_step(platform: str, **model_overrides) -> ir.Module:
    config = load_config_file("configs/zaya1_base.py")
    config.model.update(num_layers=BASE_LAYERS, **model_overrides)
    config.train.update(global_batch_size=BASE_BATCH, seq_len=BASE_SEQ, steps=100)
    config.optimizer.warmup_steps = 10
    return lower_config(config, make_mesh(settings_from_config(config).mesh.sizes), platform)


def dense_expert_shapes(module: ir.Module, num_experts: int, token_counts: set[int]) -> set[str]:
    """Tensor types with an expert axis and a token axis ([E, T, ...], [T, E, ...]): the
    temporaries of every expert computed on every token (ragged_dot's dense expansion)."""
    shapes = set(re.findall(r"tensor<((?:\d+x)+)[a-z]", str(module)))
    return {s for s in shapes if num_experts in (dims := {int(d) for d in s.split("x")[:-1]})
            and dims & token_counts}


BASE_TOKENS = {BASE_BATCH * BASE_SEQ, BASE_BATCH * BASE_SEQ // 8}  # global and per device


@pytest.mark.parametrize("platform", ["cuda", "rocm"])
def test_zaya1_base_step_lowers_to_the_auto_kernels(platform):
    """`auto` today (zaya_jax/model/kernels.py): XLA attention and the Pallas grouped matmul on
    both GPU platforms. The lowered step holds exactly the grouped-matmul Triton calls of one
    (scanned) layer body: gate and up in one call and down in another, their two input-gradient
    calls and the three weight gradients; no flash attention call and no other custom call
    (attention is plain HLO dots);
    every call inside shard_map; no ragged_dot and no [E, T, ...] expert temporary."""
    module = lowered_base_step(platform)
    calls = triton_calls(module)
    assert all(manual for _, manual in calls), [k for k, manual in calls if not manual]
    assert collections.Counter(k for k, _ in calls) == {"gmm_x2": 1, "gmm": 1, "gmm_transposed_rhs_x2": 1,
                                                         "gmm_transposed_rhs": 1, "tgmm": 3}
    text = str(module)
    assert set(re.findall(r"stablehlo.custom_call @([\w$.]+)", text)) == {TRITON}
    assert "stablehlo.dot_general" in text
    assert "ragged_dot" not in text
    assert not dense_expert_shapes(module, BASE_EXPERTS, BASE_TOKENS)


def test_dense_expert_temporaries_are_recognised():
    """The check above can fail: the `dense` backend (every expert on every token) has them."""
    module = lowered_base_step("cuda", moe_backend="dense")
    assert dense_expert_shapes(module, BASE_EXPERTS, BASE_TOKENS)


# MLIR's names of the FP8 formats (zaya_jax.model.fp8.Formats holds jnp's)
MLIR_F8 = {"float8_e4m3fn": "f8E4M3FN", "float8_e5m2": "f8E5M2", "float8_e4m3fnuz": "f8E4M3FNUZ",
           "float8_e5m2fnuz": "f8E5M2FNUZ"}


def fp8_products(text: str) -> collections.Counter:
    """{(op, lhs element type, rhs element type): count} of the dots and ragged dots with an FP8 operand."""
    found = collections.Counter()
    for op, lhs, rhs in re.findall(r'(stablehlo\.dot_general|"chlo\.ragged_dot").*?: \(tensor<[\dx]*(\w+)>, '
                                   r'tensor<[\dx]*(\w+)>', text):
        if lhs.startswith("f8") or rhs.startswith("f8"):
            found[(op.strip('"'), lhs, rhs)] += 1
    return found


@pytest.mark.parametrize("platform", ["cuda", "rocm"])
def test_zaya1_base_fp8_step_lowers_with_the_platforms_fp8_dots(platform):
    """model.matmul_precision=fp8 on the ZAYA1-base step (its widths, two scanned layers): the
    lowered program multiplies in the chip's FP8 family, OCP for the H200 (cuda), FNUZ for the
    MI300X (gfx942, rocm). Per layer body: CCA's 5 projections (q, k, two v, o) as dot_general
    and the 3 expert matmuls (gate, up, down) as ragged_dot, each e4m3 x e4m3 forward, e5m2 x
    e4m3 input gradient and e4m3 x e5m2 weight gradient; no FP8 type of the other family."""
    from zaya_jax.model import fp8
    forward, backward = (MLIR_F8[name] for name in (fp8.OCP if platform == "cuda" else fp8.FNUZ))
    text = str(lowered_base_step(platform, matmul_precision="fp8"))
    expected = collections.Counter()
    for op, n in (("stablehlo.dot_general", 5), ("chlo.ragged_dot", 3)):
        for types in ((forward, forward), (backward, forward), (forward, backward)):
            expected[(op, *types)] = n
    assert fp8_products(text) == expected
    assert set(re.findall(r"f8E\w+", text)) == {forward, backward}


def lowered_engine_calls(platform: str, slots: int) -> dict[str, str]:
    """The serving engine's compiled calls (zaya_jax.engine.step: a 2-row prompt chunk of 16 beside
    every slot's decode step, a decode block; the prefix cache's restore of a 2-block hit) for
    configs/tiny.py's model (4 experts, scanned layers) with `slots` rows of 48 positions, lowered
    for `platform` from abstract shapes -> their StableHLO text by name."""
    import numpy as np
    from flax import nnx

    from zaya_jax.config_files import model_config
    from zaya_jax.engine.prefix_cache import restore, snapshot
    from zaya_jax.engine.step import STOP_IDS, RowSampling, engine_chunk, engine_decode
    from zaya_jax.infer.cache import state_shapes
    from zaya_jax.model.build import create_model
    cfg = model_config(load_config_file("configs/tiny.py"))
    graphdef, params = nnx.split(nnx.eval_shape(lambda: create_model(cfg, seed=0)))
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    state, chunk = state_shapes(cfg, slots, 48), 16

    def ints(*shape, dtype=np.int32):
        return jax.ShapeDtypeStruct(shape, dtype)

    def rows(n):
        return RowSampling(ints(n, dtype=np.float32), ints(n), ints(n, dtype=np.float32), ints(n, dtype=np.uint32),
                           ints(n), ints(n))
    entry = jax.eval_shape(functools.partial(snapshot, block=chunk), state, ints(), ints())
    lowered = {
        "chunk": lower_for_gpu(platform, engine_chunk, graphdef, params, state, ints(2), ints(slots), ints(2, chunk),
                               ints(2), rows(2), ints(slots), ints(slots), rows(slots), top=5),
        "decode": lower_for_gpu(platform, engine_decode, graphdef, params, state, ints(slots), ints(slots),
                                ints(slots), ints(slots, STOP_IDS), rows(slots), ints(), top=5, block=8),
        "restore": lower_for_gpu(platform, restore, state, ints(), ints(2), (entry, entry)),
    }
    return {name: low.as_text() for name, low in lowered.items()}


@pytest.mark.parametrize("platform", ["cuda", "rocm"])
def test_the_serving_engines_calls_lower_to_the_auto_kernels(platform):
    """The engine's MoE runs the GPU's grouped matmul: gate and up in one Pallas call and down in
    another, once in the scanned layer body of a chunk call (its prompt rows and the decode rows
    in one dispatch) and of a decode block of 8 slots (more tokens than the 4 experts); with 4
    slots a decode step gathers each token's expert weights instead (infer.decode: no more tokens
    than experts), with no kernel. No ragged_dot, no other custom call; the restore lowers too."""
    for slots, decode_kernels in ((8, {"gmm_x2": 1, "gmm": 1}), (4, {})):
        texts = lowered_engine_calls(platform, slots)
        for name, expected in (("chunk", {"gmm_x2": 1, "gmm": 1}), ("decode", decode_kernels), ("restore", {})):
            module = ir.Module.parse(texts[name], context=jax_mlir.make_ir_context())
            assert collections.Counter(k for k, _ in triton_calls(module)) == expected, (slots, name)
            assert set(re.findall(r"stablehlo.custom_call @([\w$.]+)", texts[name])) <= {TRITON}, (slots, name)
            assert "ragged_dot" not in texts[name], (slots, name)
