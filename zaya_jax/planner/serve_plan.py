"""Serving one model on one GPU: weights, per-request decode state, slots, decode tokens/s.

Shapes: L layers, E experts (top-1), D hidden, I expert hidden, N query heads, K KV heads, H head
dim, V vocab, T = context (cache slots per request), B concurrent requests (the decode batch).

  weights     bytes of the served weights, from the abstract model's state (nothing allocated):
              float arrays in the compute dtype (cfg.dtype, bfloat16 for ZAYA1), or int8 / int4
              weight-only as zaya_jax.checkpoints.quantize.quantize_model stores them (integers plus
              float32 group scales; the embedding, router, convolutions and norms stay float, in
              cfg.dtype). Split into the experts' gate/up/down (one expert of one layer:
              `expert`) and everything else (`always`: every decode step reads it whole; the
              tied embedding is the output head).
  state       one request's DecodeState at T slots (zaya_jax.infer.cache.state_shapes): the
              full layers' keys and values [T,K,H] each, the sliding layers' ring buffers
              [min(window, T),K,H], the CCA carry (2 C H + K/2 H numbers per layer), its length.
  slots       requests that fit: floor((memory * (1 - reserve) - weights) / state), the reserve
              being what activations, the logits and the runtime's workspace take (default 10%,
              vLLM's gpu_memory_utilization=0.9).
  decode step a roofline on the profile's achieved rates (hardware.HardwareProfile.achieved):
                bytes  = always + L * distinct_experts(E, B) * expert + B * state
                flops  = B * (L * layer matmuls + 2*2*N*H*(keys held) + 2*D*V)
                step_s = max(bytes / HBM rate, flops / matmul rate); tokens/s = B / step_s
              The layer matmuls are zaya_jax.planner.step_flops.layer_matmuls' forward FLOPs per
              token (one expert row per token: decode gathers each token's expert for B <= E,
              else the GPU's dispatch backend runs), the scores are the decode's: every held key
              of each layer, T for a full layer, min(window, T) for a sliding one
              (zaya_jax.infer.cache.cached_attention reads every slot and masks).
Assumptions (SERVE_ASSUMPTIONS, printed with the prediction): every request holds a full context
of T tokens; every token routes to a real expert, uniformly and independently (the skip slot and
routing skew would read fewer experts); each step reads each hit expert once (zaya_jax's own
decode_step gathers one copy per token for B <= E, up to B / distinct_experts more expert bytes);
the state is read once per step (the new key/value and carry writes, activations and sampling are
left out); no tensor or expert parallelism, one GPU.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from zaya_jax.config import ConfigError, ModelConfig
from zaya_jax.hardware import HardwareProfile
from zaya_jax.infer.cache import state_shapes
from zaya_jax.checkpoints.quantize import MODES, QUANTIZED_WEIGHTS, QuantizedArray, quantize_model
from zaya_jax.model.kernels import resolve_moe_backend
from zaya_jax.model.zaya import ZayaLM
from zaya_jax.planner.step_flops import expert_rows_per_token, layer_matmuls

RESERVE_FRACTION = 0.10
EXPERT_WEIGHTS = {key for key in QUANTIZED_WEIGHTS if key[0] == "moe"}
SERVE_ASSUMPTIONS = (
    "each decode step reads the weights of the experts its tokens route to (top-1, uniform independent routing "
    "over the E real experts: E*(1-(1-1/E)^B) distinct experts per layer, each read once) plus every other weight "
    "whole, and every running request's whole decode state at the full context (cache + CCA carry, read once); "
    "time = max(bytes / achieved HBM rate, matmul FLOPs / achieved matmul rate); writes, activations, sampling, "
    "prefill and launch overheads are left out; memory keeps a reserve for activations and workspace")


def weight_formats(cfg: ModelConfig) -> tuple[str, ...]:
    """The weight formats predicted: float in cfg.dtype (e.g. 'bfloat16'), then 'int8', 'int4'."""
    return (cfg.dtype, *MODES)


def weight_bytes(cfg: ModelConfig, weights: str, group_size: int) -> dict[str, float]:
    """Bytes of the served weights (module doc). weights: cfg.dtype or a quantize mode;
    group_size: entries per float32 scale along a quantized weight's input axis.
    -> {'experts': all experts' gate/up/down, 'expert': one expert of one layer (experts / (L E)),
        'always': everything else, 'total'}."""
    def served_state():
        model = ZayaLM(cfg, rngs=nnx.Rngs(0))
        return nnx.state(quantize_model(model, weights, group_size) if weights in MODES else model)

    float_bytes = jnp.dtype(cfg.dtype).itemsize
    experts = always = 0
    for path, var in nnx.to_flat_state(jax.eval_shape(served_state)):
        value = var.get_value()
        if isinstance(value, QuantizedArray):
            held = value.values.size * value.values.dtype.itemsize + value.scales.size * value.scales.dtype.itemsize
        else:
            held = value.size * (float_bytes if jnp.issubdtype(value.dtype, jnp.floating) else value.dtype.itemsize)
        if tuple(str(p) for p in path[-2:]) in EXPERT_WEIGHTS:
            experts += held
        else:
            always += held
    return {"experts": experts, "expert": experts / (cfg.num_layers * cfg.num_experts), "always": always,
            "total": experts + always}


def request_state_bytes(cfg: ModelConfig, context: int) -> dict[str, int]:
    """Bytes of one request's decode state at `context` cache slots, by part, from the abstract
    DecodeState (zaya_jax.infer.cache.state_shapes) in cfg.dtype."""
    state = state_shapes(cfg, 1, context)

    def held(*arrays) -> int:
        return sum(x.size * x.dtype.itemsize for x in arrays)

    parts = {"kv_full_layers": held(state.keys, state.values),
             "kv_sliding_layers": held(state.window_keys, state.window_values),
             "cca_carry": held(*state.carry), "length": held(state.lengths)}
    return parts | {"total": sum(parts.values())}


def distinct_experts(num_experts: int, batch: int) -> float:
    """Expected distinct experts that `batch` tokens routed top-1, uniformly and independently,
    over `num_experts` experts hit: E * (1 - (1 - 1/E)^B)."""
    return num_experts * (1 - (1 - 1 / num_experts) ** batch)


def slots(memory_bytes: float, weights: float, state: float, reserve_fraction: float) -> int:
    """Requests of `state` bytes each that fit beside `weights` bytes in memory_bytes less the reserve."""
    return max(0, math.floor((memory_bytes * (1 - reserve_fraction) - weights) / state))


def decode_flops_per_token(cfg: ModelConfig, context: int, batch: int) -> float:
    """Matmul FLOPs of one decoded token in a batch of `batch` at `context` cache slots (module doc)."""
    backend = resolve_moe_backend(cfg.moe_backend, "gpu")
    rows = 1.0 if batch <= cfg.num_experts else expert_rows_per_token(cfg, backend, batch)
    # only the training scores op reads the sequence length (1 here); the decode's replace it below
    layers = sum(op.forward_per_token for op in layer_matmuls(cfg, 1, backend, rows) if op.name != "attention/scores")
    state = state_shapes(cfg, 1, context)
    keys_held = state.keys.shape[0] * state.keys.shape[2] + state.window_keys.shape[0] * state.window_keys.shape[2]
    scores = 2 * 2 * cfg.num_q_heads * cfg.head_dim * keys_held
    return cfg.num_layers * layers + scores + 2 * cfg.hidden_size * cfg.vocab_size


def decode_step(cfg: ModelConfig, weights: dict[str, float], state_bytes: int, context: int, batch: int,
                hw: HardwareProfile) -> dict:
    """The roofline of one decode step of `batch` requests (module doc); weights: weight_bytes'."""
    rates = hw.achieved()
    hit = distinct_experts(cfg.num_experts, batch)
    step_bytes = weights["always"] + cfg.num_layers * hit * weights["expert"] + batch * state_bytes
    flops = batch * decode_flops_per_token(cfg, context, batch)
    memory_s, compute_s = step_bytes / rates["hbm_bytes"], flops / rates["matmul_flops"]
    step_s = max(memory_s, compute_s)
    return {"batch": batch, "experts_per_layer": hit, "bytes": step_bytes, "flops": flops, "memory_s": memory_s,
            "compute_s": compute_s, "step_s": step_s, "tokens_per_s": batch / step_s,
            "bound_by": "memory" if memory_s >= compute_s else "compute"}


def batches(max_batch: int) -> list[int]:
    """The decode batches reported: 1, 2, 4, ... below max_batch, and max_batch (none for 0)."""
    powers = [2 ** i for i in range(max_batch.bit_length()) if 2 ** i < max_batch]
    return powers + [max_batch] if max_batch else []


def max_context(cfg: ModelConfig, free_bytes: float) -> int:
    """The longest context (<= max_position_embeddings) whose one request's state fits free_bytes; 0 if none."""
    low, high = 0, cfg.max_position_embeddings
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if request_state_bytes(cfg, mid)["total"] <= free_bytes else (low, mid - 1)
    return low


def check_context(cfg: ModelConfig, context: int) -> None:
    """A ConfigError unless 1 <= context <= model.max_position_embeddings."""
    if not 1 <= context <= cfg.max_position_embeddings:
        raise ConfigError(f"--context {context}: the model serves 1 to {cfg.max_position_embeddings} tokens "
                          f"(model.max_position_embeddings)\nfix: a --context from 1 to {cfg.max_position_embeddings}")


def plan_serving(cfg: ModelConfig, hw: HardwareProfile, context: int, memory_gb: float,
                 reserve_fraction: float = RESERVE_FRACTION, group_size: int = 64) -> dict:
    """Serving on one `hw` GPU of memory_gb GB (1e9 bytes) at `context` tokens per request: per
    weight format its bytes, the slots and the decode roofline at batches(slots). A ConfigError
    when the context is out of range or not one request fits with the smallest weights."""
    check_context(cfg, context)
    state = request_state_bytes(cfg, context)
    memory = memory_gb * 1e9
    usable = memory * (1 - reserve_fraction)
    formats = {}
    for name in weight_formats(cfg):
        weights = weight_bytes(cfg, name, group_size)
        fit = slots(memory, weights["total"], state["total"], reserve_fraction)
        formats[name] = {"weight_bytes": weights, "slots": fit,
                         "decode": [decode_step(cfg, weights, state["total"], context, b, hw) for b in batches(fit)]}
    if not any(f["slots"] for f in formats.values()):
        smallest = min(formats, key=lambda name: formats[name]["weight_bytes"]["total"])
        longest = max_context(cfg, usable - formats[smallest]["weight_bytes"]["total"])
        fix = f"--context {longest} or less (the longest one request holds beside {smallest} weights)" if longest \
            else "a GPU with more memory (--hardware, --device_memory_gb)"
        raise ConfigError(f"--context {context}: not one request fits on {hw.name} ({memory_gb:.0f} GB, "
                          f"{reserve_fraction:.0%} reserved): its decode state is {state['total'] / 1e9:.2f} GB "
                          f"and {usable / 1e9 - formats[smallest]['weight_bytes']['total'] / 1e9:.2f} GB is left after "
                          f"the {smallest} weights\nfix: {fix}")
    rates = hw.achieved()
    return {"hardware": hw.name, "context": context, "memory_bytes": memory, "reserve_fraction": reserve_fraction,
            "group_size": group_size, "achieved_hbm_bytes_per_s": rates["hbm_bytes"],
            "achieved_matmul_flops_per_s": rates["matmul_flops"], "state_bytes_per_request": state,
            "formats": formats, "assumptions": SERVE_ASSUMPTIONS}
