"""Per-device memory and communication of one training step, computed from shapes alone.

Bytes per device for parameters (fp32 master), gradients (fp32, sharded like the parameters),
optimizer state (AdamW: m and v; Muon: one momentum for matrices, m and v for the rest; sharded
like the parameters, or also over `data` with optimizer-state sharding), activations (what the
remat policy keeps for the backward pass, per micro-batch) and what FSDP holds unsharded at
once (one layer's gathered parameters and unsharded gradient: fsdp_gathered_memory), plus the
collective bytes each device sends per step by kind. A DPO run (objective 'dpo') and a GRPO run
with a KL term (objective 'grpo', grpo.beta > 0) also hold a frozen reference model
(StepShape.holds_reference): an fp32 copy of the parameters, sharded like them (`reference_model`;
its forward pass keeps no activations for a backward pass, so the per-layer live estimate covers
it). The loss head's fp32 logits chunk (`loss_logits_chunk`) spans the positions it computes: every
one, or a GRPO step's T completion columns of each row (StepShape.loss_head_positions).
The lm and sft loss head accumulates the fp32 gradient of the tied embedding with its forward
(`loss_head_weight_grad`, sharded like the embedding; zaya_jax.train.loss.weighted_nll_sum).
A vision-language step (StepShape.vision, a config with a `vision` section) also holds the tower's
parameters, gradients and AdamW state (the trainer's params tree {text, vision}: the tower's leaves
listed under `vision/`, sharded by the same rules, counted by the same code) and its activations
for train.patch_capacity patches per row (zaya_jax.planner.tower_plan); with train.freeze_text the
text weights but the vision LoRA (train.optimizer.text_weight) have no gradient, no optimizer state
and no gradient collectives (their parameters are still gathered by FSDP); `vision` in the plan
gives the tower's share. A vision run needs mesh.context = 1 (train.settings.check_vision_run).
Activation counts are estimates (numbers saved per token per layer, listed below);
benchmarks/planner/planner_vs_xla.py compares them with XLA's compiled memory analysis.
"""

from __future__ import annotations

import dataclasses
import functools
import math

from flax import nnx

from zaya_jax.config import ModelConfig
from zaya_jax.model.attention_core import query_block_size
from zaya_jax.model.build import abstract_model
from zaya_jax.model.moe_dispatch import capacity_per_expert
from zaya_jax.model.vision.accounting import tower_parameter_state
from zaya_jax.model.vision.config import VisionConfig
from zaya_jax.parallel.gradient_reduce import summed_by_hand
from zaya_jax.parallel.mesh import MESH_AXES, check_platform_support
from zaya_jax.parallel.rules import state_specs, with_zero1_axes, zero1_axes
from zaya_jax.planner.step_flops import expert_backend
from zaya_jax.planner.tower_plan import tower_activation_memory
from zaya_jax.train.objectives import fuses_loss_head
from zaya_jax.train.optimizer import MUON_MATRICES, TEXT_PREFIX, text_weight

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class StepShape:
    global_batch: int           # sequences per optimizer step
    seq_len: int
    grad_accum: int = 1         # micro-batches per step
    optimizer: str = "adamw"    # adamw | muon
    shard_optimizer_over_data: bool = False
    platform: str = "gpu"       # the target's platform: picks the `auto` MoE backend
    ns_steps: int = 5           # Muon's Newton-Schulz iterations
    distributed_muon: bool = False  # optimizer.muon_distributed: Newton-Schulz spread over data x context
    loss_chunk: int = 512       # train.loss_chunk_size: positions per chunk of the loss head
    objective: str = "lm"       # train.objective: lm | sft | dpo | grpo
    loss_head_positions: int = 0  # positions per row the loss head computes logits for; 0: all seq_len
                                  # (grpo: grpo.max_completion_length, its columns from max_prompt_length - 1 on)
    grpo_beta: float = 0.0      # grpo.beta: the weight of GRPO's KL to a frozen reference model (> 0: one is held)
    gradient_reduce_dtype: str = "float32"  # mesh.gradient_reduce_dtype: the data-axis gradient sum's wire dtype
    vision: VisionConfig | None = None  # a vision-language step: the tower (the config's vision section)
    patch_capacity: int = 0     # train.patch_capacity: image patches per row the tower runs on
    freeze_text: bool = False   # train.freeze_text: the text weights (not the vision LoRA) are frozen

    @property
    def loss_head_len(self) -> int:
        """Positions per row the loss head computes logits for (train.step.batch_nll's columns from scored_from)."""
        return self.loss_head_positions or self.seq_len

    @property
    def holds_reference(self) -> bool:
        """Whether the step holds a frozen reference model and runs it forward: dpo, and grpo with a
        KL term (train.objectives' needs_reference)."""
        return self.objective == "dpo" or (self.objective == "grpo" and self.grpo_beta > 0)


def _shard_factor(spec, mesh: dict[str, int]) -> int:
    n = 1
    for entry in spec:
        for axis in ((entry,) if isinstance(entry, str) else (entry or ())):
            n *= mesh[axis]
    return n


def trained(path: tuple[str, ...], shape: StepShape) -> bool:
    """Whether a parameter (a _parameters path) has a gradient and optimizer state: every one but,
    under train.freeze_text, the text weights the trainer freezes (train.optimizer.text_weight)."""
    name = "/".join(path)
    return not (shape.freeze_text and text_weight(name if path[0] == "vision" else TEXT_PREFIX + name))


@functools.lru_cache(maxsize=4)
def _parameter_state(cfg: ModelConfig) -> nnx.State:
    """The abstract parameters (built once per config: a mesh search plans hundreds of meshes)."""
    return nnx.state(abstract_model(cfg), nnx.Param)


def parameter_states(cfg: ModelConfig, vision: VisionConfig | None = None) -> dict[tuple[str, ...], nnx.State]:
    """{path prefix: abstract parameters}: the text model's at (), with `vision` the tower's at ('vision',)."""
    return {(): _parameter_state(cfg), **({("vision",): tower_parameter_state(vision)} if vision else {})}


def _parameters(cfg: ModelConfig, mesh: dict[str, int], vision: VisionConfig | None = None
                ) -> list[tuple[tuple[str, ...], tuple[int, ...], object]]:
    """(path, shape, PartitionSpec) of every parameter of the model; with `vision` the tower's too,
    under ('vision', ...) as in the trainer's params tree (the text model's keep their own paths)."""
    def listed(state: nnx.State, prefix: tuple[str, ...]) -> list:
        specs = state_specs(state, mesh)
        return [(prefix + tuple(map(str, path)), tuple(var.shape), spec.get_value())
                for (path, spec), (_, var) in zip(nnx.to_flat_state(specs), nnx.to_flat_state(state))]
    return [entry for prefix, state in parameter_states(cfg, vision).items() for entry in listed(state, prefix)]


def parameter_memory(cfg: ModelConfig, mesh: dict[str, int], shape: StepShape,
                     parameters: list | None = None) -> dict[str, float]:
    """Bytes per device of parameters, gradients and optimizer state (and the reference model, if held):
    Muon keeps one momentum for MUON_MATRICES, AdamW two moments for every other trained parameter."""
    params = grads = opt = 0.0
    for path, var_shape, spec in parameters or _parameters(cfg, mesh, shape.vision):
        numel = math.prod(var_shape)
        per_device = numel * 4 / _shard_factor(spec, mesh)
        params += per_device
        if not trained(path, shape):
            continue
        grads += per_device
        opt_spec = with_zero1_axes(spec, var_shape, mesh) if shape.shard_optimizer_over_data else spec
        slots = 1 if shape.optimizer == "muon" and "/".join(path) in MUON_MATRICES else 2
        opt += slots * numel * 4 / _shard_factor(opt_spec, mesh)
    memory = {"params": params, "grads": grads, "optimizer_state": opt}
    if shape.holds_reference:
        memory["reference_model"] = params
    return memory


def muon_matrices(mesh: dict[str, int], shape: StepShape, parameters: list) -> list[tuple]:
    """(shape, MuonDimensionNumbers, devices that split its Newton-Schulz) of each parameter Muon
    orthogonalises, as the compiled steps show (tests/test_plan_flops.py, tests/test_muon_traffic.py).
    With shape.distributed_muon its [B, m, n] stack is spread over the R ranks of the data-parallel
    group (zaya_jax.train.optimizer: each takes ceil(B / R) matrices) and the parameter's own
    sharding splits each matrix further. Without, the partitioner keeps the optimizer state's
    layout (zero1_slice): on a ZeRO-1 slice of a matrix axis every Newton-Schulz matmul runs on the
    slice (and gathers the other operand, collectives below); on a slice of the leading stack axis
    each rank orthogonalises its own matrices; a slice of a later stack axis is gathered into whole
    matrices, and every replica orthogonalises all of them, as without ZeRO-1."""
    if shape.optimizer != "muon":
        return []
    replicas = math.prod(mesh[a] for a in zero1_axes(mesh))
    out = []
    for path, var_shape, spec in parameters:
        dims = MUON_MATRICES.get("/".join(path))
        if dims is None or not trained(path, shape):
            continue
        split = _shard_factor(spec, mesh)
        if shape.distributed_muon:
            split *= (stack := muon_stack(var_shape, dims)) / math.ceil(stack / replicas)
        elif zero1_slice(var_shape, spec, dims, mesh, shape) in ("matrix", "leading stack"):
            split = _shard_factor(with_zero1_axes(spec, var_shape, mesh), mesh)
        out.append((var_shape, dims, split))
    return out


def muon_stack(var_shape: tuple[int, ...], dims) -> int:
    """B: the matrices of a parameter's [B, m, n] Muon stack (the product of its batch axes)."""
    return math.prod(n for a, n in enumerate(var_shape) if a not in _matrix_axes(var_shape, dims))


def _matrix_axes(var_shape: tuple[int, ...], dims) -> set[int]:
    return {a % len(var_shape) for a in (*dims.reduction_axis, *dims.output_axis)}


def zero1_slice(var_shape: tuple[int, ...], spec, dims, mesh: dict[str, int], shape: StepShape) -> str | None:
    """Which axis of a Muon parameter ZeRO-1 (rules.with_zero1_axes) slices: 'matrix', 'leading stack'
    (the first of its stack axes), 'stack' (a later one), or None (no ZeRO-1, or no axis divides)."""
    if not shape.shard_optimizer_over_data:
        return None
    sliced = [d for d, (a, b) in enumerate(zip(list(spec) + [None] * len(var_shape),
                                               with_zero1_axes(spec, var_shape, mesh))) if a != b]
    if not sliced:
        return None
    matrix = _matrix_axes(var_shape, dims)
    if sliced[0] in matrix:
        return "matrix"
    return "leading stack" if sliced[0] == min(set(range(len(var_shape))) - matrix) else "stack"


def probability_widths(cfg: ModelConfig, seq_len: int) -> list[int]:
    """[L] keys per query row of each layer's XLA attention probabilities: S for a full layer; a
    sliding layer's query block reads at most its rows plus window - 1 keys (attention_core)."""
    windowed = min(seq_len, query_block_size(seq_len) + cfg.sliding_window - 1)
    return [windowed if sliding else seq_len for sliding in cfg.sliding_layers]


def saved_numbers_per_token_per_layer(cfg: ModelConfig, remat: str, seq_len: int, attention: str) -> float:
    """Numbers one decoder layer keeps per token for the backward pass (estimate); seq_len: the
    keys its probabilities span (probability_widths).

    none: every intermediate (attention probabilities [N, S] per token on the XLA path, or the
    logsumexp with a flash kernel); dots / dots_no_batch: the weight-matmul outputs;
    dots_no_batch_and_kernels: those and, with a flash kernel, its output and fp32 logsumexp;
    full: only the layer inputs (stream and router state), everything else is recomputed.
    """
    d, n, k, h, i, r = (cfg.hidden_size, cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim,
                        cfg.moe_intermediate_size, cfg.router_hidden_size)
    c = n + k
    carry = d + r
    if remat == "full":
        return carry
    matmul_outputs = (n + k) * h + k * h + d + 3 * r + (cfg.num_router_classes) + 3 * i + d
    if remat in ("dots", "dots_no_batch"):
        return carry + matmul_outputs + (2 * c * h if remat == "dots" else 0)
    if remat == "dots_no_batch_and_kernels":
        return carry + matmul_outputs + (n * h + 2 * n if attention == "flash" else 0)
    probs = 2 * n * seq_len if attention == "xla" else n
    elementwise = 6 * d + 7 * c * h + n * h + 6 * r + 2 * (cfg.num_router_classes) + 2 * i + 3 * d
    return carry + matmul_outputs + elementwise + probs


def dispatch_numbers_per_layer(cfg: ModelConfig, tokens: float, mesh: dict[str, int], platform: str) -> float:
    """Buffers the MoE dispatch backend keeps for the backward pass, per layer and device."""
    d, i, e = cfg.hidden_size, cfg.moe_intermediate_size / mesh["tensor"], cfg.num_experts
    backend = expert_backend(cfg, mesh, platform)
    if mesh["expert"] > 1 and backend != "capacity":  # all_gather, ragged_all_to_all: a buffer of the group's tokens
        tokens *= mesh["expert"]
    if backend == "tiles":  # expert_windows' residuals over T + W rows: the sorted rows, gate and up pre-activations
        return (tokens + cfg.moe_tile_size) * (d + 2 * i)
    if backend == "capacity":
        return e * capacity_per_expert(int(tokens), e, cfg.capacity_factor) * (d + 3 * i)
    if backend == "dense":
        return tokens * e * (d + 3 * i)
    return tokens * (d + 3 * i)


def activation_memory(cfg: ModelConfig, mesh: dict[str, int], shape: StepShape) -> dict[str, float]:
    token_shards = mesh["data"] * mesh["fsdp"] * mesh["expert"] * mesh["context"]
    tokens = shape.global_batch * shape.seq_len / shape.grad_accum / token_shards
    dtype_bytes = 2 if cfg.dtype == "bfloat16" else 4
    attention = "xla" if cfg.attention_kernel in ("auto", "xla") else "flash"
    widths = probability_widths(cfg, shape.seq_len // mesh["context"])
    saved = tokens * sum(saved_numbers_per_token_per_layer(cfg, cfg.remat, w, attention) for w in widths) * dtype_bytes
    if cfg.remat != "full":
        saved += dispatch_numbers_per_layer(cfg, tokens, mesh, shape.platform) * cfg.num_layers * dtype_bytes
    # during the backward of one layer its full set of intermediates is live again (the widest layer's)
    live = tokens * max(saved_numbers_per_token_per_layer(cfg, "none", w, attention) for w in widths)
    live *= dtype_bytes
    scored = shape.loss_head_len  # positions per row the loss head computes logits for
    logits_chunk = tokens * scored / shape.seq_len * cfg.vocab_size / mesh["tensor"] * 4 / max(1, scored // 512)
    out = {"activations_saved": saved, "activations_live_layer": live, "loss_logits_chunk": logits_chunk,
           "tokens_per_device_per_microbatch": tokens}
    if shape.vision is not None:  # rows split over the batch axes (a vision run has context 1)
        rows = shape.global_batch / shape.grad_accum / (mesh["data"] * mesh["fsdp"] * mesh["expert"])
        tower = tower_activation_memory(shape.vision, cfg.remat, rows, shape.patch_capacity, mesh["tensor"])
        out["vision_activations_saved"] = tower["vision_activations_saved"]
        # the tower's backward runs after the text model's: one of its blocks or one text layer is live
        out["activations_live_layer"] = max(live, tower["vision_activations_live_block"])
    return out


def fsdp_gathered_memory(cfg: ModelConfig, mesh: dict[str, int], parameters: list | None = None,
                         shape: StepShape | None = None) -> float:
    """What FSDP keeps unsharded at the peak (the backward of one layer), bytes per device.

    The stacked layers are gathered one layer at a time inside the scan, forward and backward,
    with no prefetch of the next layer (docs/parallel.md, data / fsdp); while a layer's backward
    runs, its gathered parameters (compute dtype) and its whole gradient before the reduce-scatter
    (fp32) are live. So is the whole fp32 gradient of the unstacked FSDP-sharded weights (the
    tied embedding: its loss-head and lookup contributions are summed before one reduce-scatter).
    Only dimensions sharded over `fsdp` are unsharded; `tensor` and `expert` shards stay. A vision
    step's tower blocks (stacked too) run their backward after the text layers': the larger of one
    text layer and one tower block counts; parameters without a gradient (`trained`) hold none.
    """
    if mesh["fsdp"] == 1:
        return 0.0
    dtype_bytes = 2 if cfg.dtype == "bfloat16" else 4
    without_fsdp = {**mesh, "fsdp": 1}
    shape = shape or StepShape(1, 1)
    stack = {"layers": 0.0, "vision/blocks": 0.0}
    unstacked = 0.0
    for path, var_shape, spec in parameters or _parameters(cfg, mesh, shape.vision):
        if _shard_factor(spec, mesh) == _shard_factor(spec, without_fsdp):
            continue  # not sharded over fsdp: never gathered
        numel = math.prod(var_shape) / _shard_factor(spec, without_fsdp)
        grad_bytes = 4 if trained(path, shape) else 0
        stacked = next((s for s in stack if "/".join(path).startswith(s + "/")), None)
        if stacked:
            stack[stacked] += numel / var_shape[0] * (dtype_bytes + grad_bytes)
        else:
            unstacked += numel * grad_bytes
    return max(stack.values()) + unstacked


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of the step: bytes each device sends over a mesh axis per optimizer step."""
    kind: str          # all_gather | reduce_scatter | all_reduce | all_to_all | collective_permute
    axis: str          # the mesh axis whose devices take part, or axes joined by '+' (one group)
    what: str          # what it moves
    bytes: float
    overlappable: bool  # can run behind compute (weights and gradients), or on the critical path (activations)


def collectives(cfg: ModelConfig, mesh: dict[str, int], shape: StepShape, mem: dict[str, float],
                parameters: list | None = None) -> list[Collective]:
    """The step's collectives with the bytes each device sends (ring algorithms); axes of size 1 send
    nothing. parameters: _parameters(cfg, mesh), computed when not given."""
    out = []
    dtype_bytes = 2 if cfg.dtype == "bfloat16" else 4
    ring = lambda n: (n - 1) / n if n > 1 else 0.0  # noqa: E731
    grads = mem["grads"]  # of the trained parameters (all but a vision run's frozen text weights)
    fsdp = mesh["fsdp"]
    # FSDP: gather params (compute dtype) in forward and backward of every micro-batch; scatter
    # grads where each micro-batch's backward makes them (inside the micro-batch loop).
    m = shape.grad_accum
    out.append(Collective("all_gather", "fsdp", "parameters (forward and backward)",
                          2 * m * mem["params"] / 4 * dtype_bytes * fsdp * ring(fsdp), True))
    out.append(Collective("reduce_scatter", "fsdp", "gradients", m * grads * fsdp * ring(fsdp), True))
    # data-parallel replicas (data x context, rules.zero1_axes): every weight's gradient is summed
    # over both. Left to the partitioner (float32) that is one collective over the whole group
    # inside every micro-batch's backward, behind its compute; with ZeRO-1 a reduce-scatter into the
    # optimizer state's slice of the group and an all-gather of the (float32) update. Summed by
    # hand (zaya_jax.parallel.gradient_reduce, over data alone) once per step after the backward,
    # in mesh.gradient_reduce_dtype, on the critical path (the optimizer's global norm waits for
    # it); the partitioner then sums over context inside the data-manual region, in float32 per
    # micro-batch.
    group = zero1_axes(mesh) or ("data",)
    group_axis, replicas = "+".join(group), math.prod(mesh[a] for a in group)
    if summed_by_hand(mesh, shape.gradient_reduce_dtype):
        wire = grads * (2 if shape.gradient_reduce_dtype == "bfloat16" else 4) / 4
        reduced = [("data", wire, mesh["data"], False), ("context", m * grads, mesh["context"], True)]
    else:
        reduced = [(group_axis, m * grads, replicas, True)]
    for axis, sent, n, overlapped in reduced:
        if shape.shard_optimizer_over_data and axis != "context":
            out.append(Collective("reduce_scatter", axis, "gradients", sent * ring(n), overlapped))
        else:
            out.append(Collective("all_reduce", axis, "gradients", 2 * sent * ring(n), overlapped))
    if shape.shard_optimizer_over_data:
        out.append(Collective("all_gather", group_axis, "updated parameters", grads * ring(replicas), True))
    # Muon after the backward (zaya_jax.train.optimizer, muon_matrices). Distributed: the update
    # and momentum stacks to the ranks that orthogonalise them and back; from a ZeRO-1 slice an
    # all-to-all each way (each rank keeps 1/R of what it holds), from replicated state (no ZeRO-1)
    # a local slice there and an all-gather back. Not distributed, on a ZeRO-1 slice of a matrix
    # axis: each of Newton-Schulz's 3 matmuls per iteration gathers its whole other operand.
    if shape.optimizer == "muon" and replicas > 1:
        stacked = gathered = 0.0
        for path, var_shape, spec in parameters or _parameters(cfg, mesh, shape.vision):
            dims = MUON_MATRICES.get("/".join(path))
            if dims is None or not trained(path, shape):
                continue
            local = math.prod(var_shape) * 4 / _shard_factor(spec, mesh)
            stack = muon_stack(var_shape, dims)
            stacked += local * math.ceil(stack / replicas) * replicas / stack
            if zero1_slice(var_shape, spec, dims, mesh, shape) == "matrix":
                gathered += local
        if not shape.distributed_muon:
            out.append(Collective("all_gather", group_axis, "Newton-Schulz operands (Muon not distributed)",
                                  3 * shape.ns_steps * gathered * ring(replicas), False))
        elif shape.shard_optimizer_over_data:
            out.append(Collective("all_to_all", group_axis, "Muon update and momentum stacks, there and back",
                                  4 * stacked / replicas * ring(replicas), False))
        else:
            out.append(Collective("all_gather", group_axis, "Muon updates and momentum",
                                  2 * stacked * ring(replicas), False))
    tokens = shape.global_batch * shape.seq_len / (mesh["data"] * fsdp * mesh["expert"] * mesh["context"])
    act = tokens * cfg.hidden_size * dtype_bytes
    ep, tp, cp = mesh["expert"], mesh["tensor"], mesh["context"]
    # expert parallel, forward and backward: tokens out and back, padded to the capacity factor
    # (all_to_all) or just the tokens (ragged_all_to_all; uniform routing, skip-slot tokens
    # counted as sent), or the group's tokens gathered and outputs reduce-scattered (all_gather)
    if cfg.expert_parallel == "all_gather":
        out.append(Collective("all_gather", "expert", "tokens to experts", cfg.num_layers * 2 * act * ep * ring(ep),
                              False))
        out.append(Collective("reduce_scatter", "expert", "expert outputs", cfg.num_layers * 2 * act * ep * ring(ep),
                              False))
    else:
        padding = cfg.capacity_factor if cfg.expert_parallel == "all_to_all" else 1.0
        out.append(Collective("all_to_all", "expert", "tokens to experts and back",
                              cfg.num_layers * 4 * act * padding * ring(ep), False))
    # tensor parallel: attention output and MoE partial sums all-reduced, forward and backward
    out.append(Collective("all_reduce", "tensor", "attention and expert partial sums",
                          cfg.num_layers * 2 * 2 * 2 * act * ring(tp), False))
    if shape.vision is not None:  # and the tower's attention output and MLP down projection, on every patch
        patches = shape.global_batch * shape.patch_capacity / (mesh["data"] * fsdp * mesh["expert"])
        out.append(Collective("all_reduce", "tensor", "vision tower partial sums", shape.vision.depth * 2 * 2 * 2
                              * patches * shape.vision.hidden_size * dtype_bytes * ring(tp), False))
    # context parallel: K/V all-gathered per attention layer, forward and backward
    kv = tokens * 2 * cfg.num_kv_heads * cfg.head_dim * dtype_bytes
    out.append(Collective("all_gather", "context", "keys and values", cfg.num_layers * 2 * kv * cp * ring(cp), False))
    # the flash kernel's zigzag balance (zaya_jax.parallel.attention_sharding): in every full
    # causal layer half the local queries permuted there and half the outputs back, forward and
    # (as dq and do) backward
    if cp > 1 and cfg.attention_kernel == "pallas" and (shape.seq_len // cp) % 2 == 0:
        full_layers = cfg.sliding_layers.count(False)
        queries = tokens * cfg.num_q_heads * cfg.head_dim * dtype_bytes
        out.append(Collective("collective_permute", "context", "zigzag query halves and outputs",
                              full_layers * 2 * queries, False))
    return [c for c in out if c.bytes > 0]


def collective_bytes(cfg: ModelConfig, mesh: dict[str, int], shape: StepShape, mem: dict[str, float],
                     parameters: list | None = None) -> dict:
    """Bytes each device sends per optimizer step, by collective kind."""
    out = {"all_gather": 0.0, "reduce_scatter": 0.0, "all_reduce": 0.0, "all_to_all": 0.0, "collective_permute": 0.0}
    for c in collectives(cfg, mesh, shape, mem, parameters):
        out[c.kind] += c.bytes
    return out


def plan(cfg: ModelConfig, mesh: dict[str, int], shape: StepShape, device_memory_gb: float = 192.0,
         parameters: list | None = None) -> dict:
    """Per-device bytes and collective bytes of one step; `parameters` (_parameters(cfg, mesh, shape.vision))
    may be passed in when one mesh is planned for several step shapes."""
    mesh = {a: int(mesh.get(a, 1)) for a in MESH_AXES}
    check_platform_support(mesh, cfg.expert_parallel, shape.platform)
    if shape.vision is not None and mesh["context"] != 1:
        raise ValueError(f"a vision-language run needs mesh.context = 1 (image tokens attend across the "
                         f"sequence), got {mesh['context']}")
    if shape.global_batch % (mesh["data"] * mesh["fsdp"] * mesh["expert"] * shape.grad_accum):
        raise ValueError(f"train.global_batch_size {shape.global_batch} is not divisible by the batch axes "
                         f"(data*fsdp*expert = {mesh['data'] * mesh['fsdp'] * mesh['expert']}) times "
                         f"grad_accum {shape.grad_accum}")
    if shape.seq_len % mesh["context"]:
        raise ValueError(f"train.seq_len {shape.seq_len} is not divisible by mesh.context {mesh['context']}")
    parameters = parameters or _parameters(cfg, mesh, shape.vision)
    mem = parameter_memory(cfg, mesh, shape, parameters)
    act = activation_memory(cfg, mesh, shape)
    act["fsdp_gathered"] = fsdp_gathered_memory(cfg, mesh, parameters, shape)
    if fuses_loss_head(shape.objective) and trained(("embed",), shape):
        (embed_shape, embed_spec), = [(s, spec) for path, s, spec in parameters if path == ("embed",)]
        act["loss_head_weight_grad"] = math.prod(embed_shape) * 4 / _shard_factor(embed_spec, mesh)
    total = sum(mem.values()) + sum(v for k, v in act.items() if k != "tokens_per_device_per_microbatch")
    vision = {}
    if shape.vision is not None:  # the tower's share of the state above (the same rules, its parameters alone)
        tower = parameter_memory(cfg, mesh, shape, [p for p in parameters if p[0][0] == "vision"])
        vision = {"vision": {**tower, "activations_saved": act["vision_activations_saved"],
                             "patches_per_row": shape.patch_capacity, "freeze_text": shape.freeze_text}}
    return {**vision,
        "mesh": mesh, "devices": math.prod(mesh.values()),
        "step": dataclasses.asdict(shape), "remat": cfg.remat, "dtype": cfg.dtype,
        "bytes_per_device": {**mem, **{k: v for k, v in act.items() if k != "tokens_per_device_per_microbatch"},
                             "total": total},
        "tokens_per_device_per_microbatch": act["tokens_per_device_per_microbatch"],
        "collective_bytes_per_step_per_device": collective_bytes(cfg, mesh, shape, mem, parameters),
        "device_memory_bytes": device_memory_gb * 1e9,
        "fits": total <= device_memory_gb * 1e9,
    }
