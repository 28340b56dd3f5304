"""FLOPs one training step executes per device, counted from the config (matmuls only).

Shapes: D hidden, N query heads, K KV heads, C = N + K, H head dim, R router width, E experts,
I expert hidden, V vocab, S sequence, L layers. Forward FLOPs per token of one layer:

  attention/projections   2 D (N + K) H + 2 D K H (values) + 2 N H D (output)
  attention/convolution   2 * 2 C H H             the grouped kernel-2 convolution, two einsums
  attention/scores        2 * 2 N H keys          QK^T and AV; `keys` is the mean number of keys
                                                  a query's block reads (attention_keys_per_query),
                                                  averaged over the layers: a sliding layer's
                                                  blocks read only keys that meet their window
  router                  2 (D R + 2 R R + R (E + 1))
  experts                 rows * 3 * 2 D I        rows per token: 1 for the dropless backends
                                                  (every token routed to a real expert: an upper
                                                  bound, skip-slot tokens do none), E * C / T for
                                                  capacity buckets, E for dense (+ 2 E D combine)
and once per position of the loss head the tied output projection 2 D V: every position, or for
a GRPO step (objective 'grpo') only its T = grpo.max_completion_length columns from
Q - 1 = grpo.max_prompt_length - 1 on, where a completion's targets lie (TRL's logits_to_keep;
zaya_jax.train.step.batch_nll's scored_from): T of the S = Q + T - 1 positions of every row.

Passes: forward 1, backward 2 (input and weight gradients; 2.5 for the flash kernel's scores,
which recompute the probabilities), and 1 more where the remat policy recomputes the op:
`full` recomputes every layer op; `dots` saves dot_general/convolution outputs; `dots_no_batch`
saves only dot_generals without batch dimensions (jax.checkpoint_policies): the attention
scores and the grouped convolution have batch dimensions and `ragged_dot` is not a dot_general,
so they are recomputed; `dots_no_batch_and_kernels` also saves the named kernel outputs (the
expert matmuls of the capacity, ragged and native backends, the flash kernel's output and
logsumexp), so only the convolution and the XLA path's scores are recomputed.
The loss head of lm and sft computes its gradient with its forward, chunk by chunk
(zaya_jax.train.loss.weighted_nll_sum): 3 passes (logits, d hidden, d weight). A DPO or GRPO
step's loss head runs under jax.checkpoint in a loop over chunks of its positions: 4 passes
(forward, recompute, backward 2); with a single chunk there is no loop, and jax 0.10.2's XLA
merges the recompute into the forward: 3 passes there (zaya_jax.jax_versions.XLA_KEEPS_UNLOOPED_REMAT).
A vision-language step (vision_step: the tower's image tokens in the stream) with the
experts' vision LoRA dispatches to 2E experts, the E text experts and the E merged with their
adapters (zaya_jax.model.vision_lora: rows per token 2E for dense, 2E * C / T for capacity) and
runs the attention LoRA, per token 2 r (5 D + 2 N H + 2 K H) (`attention/vision_lora`; the adapter
merges, 6 E D r I per layer and step, are left out). With frozen text weights (train.freeze_text)
the backward computes no weight gradient for them: one backward pass (the input gradients, which
still flow to the image tokens and the LoRA) for every op with text weights, and 2 passes of the
loss head; but the experts with their LoRA keep 2: their weight gradient is one op over the
concatenated 2E experts' weights, which the merged image experts need (XLA computes it whole:
measured with the dense backend, tests/test_plan_vision.py; assumed for the others).
The tower's FLOPs are zaya_jax.planner.tower_plan's (added by step_time.matmul_flops).
A step that holds a frozen reference model (objective 'dpo', or 'grpo' with grpo.beta > 0:
StepShape.holds_reference) also runs it forward once, without a backward or recompute:
`reference_model`, one pass of every layer op and of the loss head (on the same positions).
The optimizer adds Muon's Newton-Schulz iterations, 4 a^2 b + 2 a^3 per step for an a x b
matrix (a <= b), split over the devices planner.muon_matrices says (with optimizer.muon_distributed,
each parameter's stack of matrices spread over the data-parallel group, zaya_jax.train.optimizer).

Per device: divided by the devices that split the work (batch axes, context, and tensor for
the ops whose heads / hidden / vocab it shards; ops it does not shard, the value projections
and the router, are computed by every tensor shard). Elementwise work is not counted here; it
is memory traffic (zaya_jax.planner.step_time). tests/test_plan_flops.py checks the count
against XLA's cost_analysis() of the compiled train step.
"""

from __future__ import annotations

import dataclasses
import math

from zaya_jax.config import ModelConfig
from zaya_jax.jax_versions import XLA_KEEPS_UNLOOPED_REMAT
from zaya_jax.model.attention_core import first_visible_key, query_block_size
from zaya_jax.model.kernels import resolve_attention_kernel, resolve_moe_backend
from zaya_jax.model.moe_dispatch import capacity_per_expert
from zaya_jax.train.loss import chunk_size_for
from zaya_jax.train.objectives import fuses_loss_head


@dataclasses.dataclass(frozen=True)
class LayerMatmul:
    name: str
    forward_per_token: float     # FLOPs, one layer's forward
    batch_dims: bool             # a dot with batch dimensions (or not a dot_general): dots_no_batch recomputes it
    activation_bytes: float      # per token forward: activation inputs read and outputs written (HBM)
    saved_by_dots: bool = True   # the `dots` policy saves it (dot_general and convolutions)
    saved_by_name: bool = False  # its outputs carry checkpoint names `dots_no_batch_and_kernels` saves
    tensor_split: bool = True    # the tensor axis splits it
    backward_passes: float = 2.0
    text_weights: bool = True    # multiplies by text weights alone (train.freeze_text drops their gradient)


def attention_keys_per_query(seq_len: int, kernel: str, window: int | None = None) -> float:
    """Mean keys each query's scores are computed against: the XLA path reads keys [0, end of
    its query block), from the block's first visible key with a window
    (zaya_jax.model.attention_core); the flash kernel skips blocks above the diagonal and before
    the window (counted as the visible keys: about half, plus the diagonal block's masked half)."""
    if kernel == "pallas":
        return sum(min(q + 1, window or seq_len) for q in range(seq_len)) / seq_len
    block = query_block_size(seq_len)
    starts = range(0, seq_len, block)
    return sum((min(start + block, seq_len) - start) * (min(start + block, seq_len) - first_visible_key(start, window))
               for start in starts) / seq_len


def mean_attention_keys(cfg: ModelConfig, seq_len: int, kernel: str) -> float:
    """attention_keys_per_query averaged over the layers, each with its type's window."""
    return sum(attention_keys_per_query(seq_len, kernel, cfg.sliding_window if sliding else None)
               for sliding in cfg.sliding_layers) / cfg.num_layers


def expert_backend(cfg: ModelConfig, mesh: dict[str, int], platform: str) -> str:
    """The dispatch the experts run: fixed-capacity buckets for the `all_to_all` expert exchange,
    else the local backend (all_gather and ragged_all_to_all hand it the received tokens)."""
    if mesh["expert"] > 1 and cfg.expert_parallel == "all_to_all":
        return "capacity"
    if cfg.matmul_precision != "default":  # FP8 experts run ragged (zaya_jax.model.kernels)
        return "ragged"
    return resolve_moe_backend(cfg.moe_backend, platform)


def dispatched_experts(cfg: ModelConfig, vision_step: bool) -> int:
    """Experts the dispatch runs: E, or 2E in a vision step with the experts' LoRA (the module doc)."""
    return cfg.num_experts * (2 if vision_step and cfg.vision_lora_rank_mlp else 1)


def expert_rows_per_token(cfg: ModelConfig, backend: str, tokens: int, experts: int | None = None) -> float:
    """Rows the expert matmuls run per token, for `tokens` tokens per dispatch over `experts` experts
    (default: cfg.num_experts; a vision step with the experts' LoRA dispatches to twice as many)."""
    experts = experts or cfg.num_experts
    if backend == "capacity":
        return experts * capacity_per_expert(tokens, experts, cfg.capacity_factor) / tokens
    return float(experts) if backend == "dense" else 1.0


def layer_matmuls(cfg: ModelConfig, seq_len: int, backend: str, rows_per_token: float,
                  vision_lora: bool = False) -> list[LayerMatmul]:
    """The matmuls of one layer; vision_lora: a vision step's, whose LoRA runs (the module doc)."""
    d, n, k, h = cfg.hidden_size, cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim
    r, e, i = cfg.router_hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    c = n + k
    b = 2 if cfg.dtype == "bfloat16" else 4
    kernel = resolve_attention_kernel(cfg.attention_kernel)
    keys = mean_attention_keys(cfg, seq_len, kernel)
    # the XLA path writes fp32 logits, reads them for the softmax, writes and reads the probabilities
    scores_bytes = b * (n + 2 * k) * h + b * n * h + (n * keys * (4 + 4 + 2 * b) if kernel != "pallas" else 0)
    lora_experts = vision_lora and cfg.vision_lora_rank_mlp > 0  # the merged image experts train
    ops = [
        LayerMatmul("attention/qk_projections", 2 * d * c * h, False, b * (d + c * h)),
        LayerMatmul("attention/value_projections", 2 * d * k * h, False, b * (d + k * h), tensor_split=False),
        LayerMatmul("attention/output_projection", 2 * n * h * d, False, b * (n * h + d)),
        LayerMatmul("attention/convolution", 2 * 2 * c * h * h, True, b * 3 * c * h),
        LayerMatmul("attention/scores", 2 * 2 * n * h * keys, True, scores_bytes, saved_by_dots=kernel != "pallas",
                    saved_by_name=kernel == "pallas", backward_passes=2.5 if kernel == "pallas" else 2.0,
                    text_weights=False),
        LayerMatmul("router", 2 * (d * r + 2 * r * r + r * (e + 1)), False, b * (d + 6 * r + e + 1),
                    tensor_split=False),
    ]
    if backend == "dense":  # 'td,edi->tei' (no batch dims), then 'tei,eid->ted' and 'ted,te->td' (batch e, t)
        ops += [LayerMatmul("experts/gate_up", rows_per_token * 2 * 2 * d * i, False, b * (d + rows_per_token * 2 * i),
                            text_weights=not lora_experts),
                LayerMatmul("experts/down_and_combine", rows_per_token * 2 * i * d + 2 * rows_per_token * d, True,
                            b * rows_per_token * (i + 2 * d), text_weights=not lora_experts)]
    else:  # capacity: batched einsums; ragged: ragged_dot; tiles: a custom VJP of loops; native: FFI calls
        ragged = backend in ("ragged", "tiles", "native")
        ops.append(LayerMatmul("experts", rows_per_token * 3 * 2 * d * i, True, b * rows_per_token * (2 * d + 4 * i),
                               saved_by_dots=not ragged, saved_by_name=backend != "tiles",
                               text_weights=not lora_experts))
    if vision_lora and cfg.vision_lora_rank_attn:
        ra = cfg.vision_lora_rank_attn
        ops.append(LayerMatmul("attention/vision_lora", 2 * ra * (5 * d + 2 * n * h + 2 * k * h), False,
                               b * (6 * d + 2 * n * h), tensor_split=False, text_weights=False))
    return ops


def recomputed(op: LayerMatmul, remat: str) -> bool:
    if remat == "full":
        return True
    if remat == "dots":
        return not op.saved_by_dots
    if remat == "dots_no_batch":
        return op.batch_dims or not op.saved_by_dots
    if remat == "dots_no_batch_and_kernels":
        return (op.batch_dims or not op.saved_by_dots) and not op.saved_by_name
    return False


def newton_schulz_flops(shape: tuple[int, ...], reduction: tuple[int, ...], output: tuple[int, ...],
                        ns_steps: int) -> float:
    """Muon's orthogonalisation of every matrix of a stacked parameter (leading axes batch)."""
    m = math.prod(shape[a] for a in reduction)
    n = math.prod(shape[a] for a in output)
    a, b = min(m, n), max(m, n)
    return math.prod(shape) / (m * n) * ns_steps * (4 * a * a * b + 2 * a ** 3)


def step_flops(cfg: ModelConfig, mesh: dict[str, int], *, global_batch: int, seq_len: int, microbatches: int,
               platform: str, optimizer_matrices: list[tuple[tuple[int, ...], object, int]],
               ns_steps: int, loss_chunk: int, objective: str = "lm", loss_head_positions: int = 0,
               reference_model: bool = False, frozen_text: bool = False,
               vision_step: bool = False) -> dict[str, float]:
    """FLOPs per device per optimizer step, by op group (forward, backward and recompute summed).

    optimizer_matrices: (shape, MuonDimensionNumbers, devices that split its Newton-Schulz) of
    every Muon parameter (planner.muon_matrices; empty for AdamW); loss_chunk: train.loss_chunk_size; objective: train.objective;
    loss_head_positions: positions per row the loss head computes logits for (0: all seq_len; GRPO's T);
    reference_model: the step runs a frozen reference model forward (StepShape.holds_reference);
    frozen_text: train.freeze_text (no weight gradients for the text model's weights); vision_step: a
    vision-language step's (the image tokens run the vision LoRA).
    """
    batch_shards = mesh["data"] * mesh["fsdp"] * mesh["expert"]
    devices_per_token = batch_shards * mesh["context"]
    tokens = global_batch * seq_len
    local_tokens = max(1, tokens // (microbatches * devices_per_token))
    backend = expert_backend(cfg, mesh, platform)
    out: dict[str, float] = {}
    forward = 0.0  # one forward pass of the whole model
    rows = expert_rows_per_token(cfg, backend, local_tokens, dispatched_experts(cfg, vision_step))
    for op in layer_matmuls(cfg, seq_len, backend, rows, vision_lora=vision_step):
        frozen = frozen_text and op.text_weights  # no weight gradient
        passes = 1 + op.backward_passes - frozen + recomputed(op, cfg.remat)
        split = devices_per_token * (mesh["tensor"] if op.tensor_split else 1)
        out[op.name] = op.forward_per_token * passes * tokens * cfg.num_layers / split
        forward += op.forward_per_token * tokens * cfg.num_layers / split
    scored = loss_head_positions or seq_len  # positions per row the loss head computes
    looped = scored // chunk_size_for(scored, loss_chunk) > 1
    loss_passes = 3 if fuses_loss_head(objective) or not (looped or XLA_KEEPS_UNLOOPED_REMAT) else 4
    loss_passes -= frozen_text
    loss_forward = (2 * cfg.hidden_size * cfg.vocab_size * global_batch * scored
                    / (devices_per_token * mesh["tensor"]))
    out["loss_head"] = loss_forward * loss_passes
    if reference_model:
        out["reference_model"] = forward + loss_forward
    out["optimizer/newton_schulz"] = sum(newton_schulz_flops(shape, dims.reduction_axis, dims.output_axis, ns_steps)
                                         / shards for shape, dims, shards in optimizer_matrices)
    return out
