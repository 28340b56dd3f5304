"""The planner's serving prediction (zaya_jax.planner.serve_plan, `--serve`): abstract shapes only."""

import functools
import json

import jax
import numpy as np
import pytest

from tests.test_plan import _assert_user_error, _plan_cli
from zaya_jax.config_files import load_config_file, model_config
from zaya_jax.hardware import PROFILES
from zaya_jax.infer.cache import empty_state
from zaya_jax.checkpoints.quantize import param_bytes, quantize_model
from zaya_jax.model.accounting import model_summary
from zaya_jax.model.build import create_model
from zaya_jax.planner.serve_plan import (decode_flops_per_token, decode_step, distinct_experts, plan_serving,
                                         request_state_bytes, slots, weight_bytes)

ZAYA1 = model_config(load_config_file("configs/zaya1_8b.py"))
TINY = model_config(load_config_file("configs/tiny.py"))
MIXED = TINY.replace(layer_types=("hybrid_sliding", "hybrid"), sliding_window=48)


@pytest.mark.parametrize("cfg,context", [(ZAYA1, 4096), (ZAYA1, 131_072), (MIXED, 40), (MIXED, 200)],
                         ids=["zaya1-4k", "zaya1-131k", "sliding-in-window", "sliding-past-window"])
def test_request_state_is_the_decode_state_of_that_context(cfg, context):
    """Independent reference: the DecodeState empty_state builds for 3 requests, traced abstractly."""
    batch = 3
    state = jax.eval_shape(functools.partial(empty_state, cfg, batch, context))
    held = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
    assert request_state_bytes(cfg, context)["total"] * batch == held


def test_zaya1_cache_is_40_kib_per_token_plus_the_carry():
    """zaya1-spec: 2 KV heads x 128 x (k, v) x 2 bytes x 40 layers = 40 KiB per token; the carry
    2*C*H + K/2*H numbers per layer (C = 8 + 2 q|k heads)."""
    at, after = request_state_bytes(ZAYA1, 4096), request_state_bytes(ZAYA1, 4097)
    assert after["kv_full_layers"] - at["kv_full_layers"] == 2 * 128 * 2 * 2 * 40 == 40 * 1024
    assert at["kv_full_layers"] == 4096 * 40 * 1024 and at["kv_sliding_layers"] == 0
    assert at["cca_carry"] == 40 * (2 * 10 * 128 + 1 * 128) * 2 == 210 * 1024


def test_distinct_experts_is_the_mean_of_top1_routing():
    rng = np.random.default_rng(0)
    experts, trials = 16, 20_000
    for batch in (1, 2, 8, 32, 100):
        hit = [len(np.unique(rng.integers(0, experts, batch))) for _ in range(trials)]
        assert abs(np.mean(hit) - distinct_experts(experts, batch)) < 4 * np.std(hit) / np.sqrt(trials) + 1e-9, batch


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_weight_bytes_are_what_quantize_model_stores(mode):
    """Against the bytes of a real quantized model (tiny is float32: every float array at 4 bytes)."""
    weights = weight_bytes(TINY, mode, 16)
    assert weights["total"] == param_bytes(quantize_model(create_model(TINY), mode, 16))
    assert weight_bytes(TINY, "float32", 16)["total"] == param_bytes(create_model(TINY))
    assert weights["expert"] * TINY.num_layers * TINY.num_experts == weights["experts"]


def test_zaya1_weight_bytes_per_format():
    weights = weight_bytes(ZAYA1, "bfloat16", 64)
    # the parameters (8.84B), the first layer's unused EDA scale and the routers' balancing biases [L, E+1]
    assert abs(weights["total"] / 2 - 8.84e9) < 0.01e9
    assert weights["experts"] == 2 * 40 * 16 * 3 * 2048 * 2048
    # quantized experts: 1 (int8) or 1/2 (int4) byte an entry and a float32 scale per 64 entries
    for mode, entry_bytes in (("int8", 1), ("int4", 0.5)):
        assert weight_bytes(ZAYA1, mode, 64)["experts"] == 40 * 16 * 3 * 2048 * 2048 * (entry_bytes + 4 / 64)


def test_slots_at_a_known_memory():
    assert slots(100e9, 10e9, 1e9, 0.1) == 80
    int4 = weight_bytes(ZAYA1, "int4", 64)["total"]
    state = request_state_bytes(ZAYA1, 4096)["total"]
    exactly_two = (int4 + 2 * state) / 0.9 / 1e9
    plan = plan_serving(ZAYA1, PROFILES["h200"], 4096, exactly_two * (1 + 1e-12))
    assert plan["formats"]["int4"]["slots"] == 2 and plan["formats"]["bfloat16"]["slots"] == 0
    assert [d["batch"] for d in plan["formats"]["int4"]["decode"]] == [1, 2]
    assert plan_serving(ZAYA1, PROFILES["h200"], 4096, exactly_two * (1 - 1e-9))["formats"]["int4"]["slots"] == 1


def test_decode_step_reads_the_hit_experts_and_every_state():
    hw = PROFILES["mi300x"]
    weights = weight_bytes(ZAYA1, "bfloat16", 64)
    state = request_state_bytes(ZAYA1, 4096)["total"]
    one, many = (decode_step(ZAYA1, weights, state, 4096, b, hw) for b in (1, 512))
    assert one["bytes"] == weights["always"] + 40 * weights["expert"] + state
    assert many["bytes"] == pytest.approx(weights["total"] + 512 * state)
    for step in (one, many):
        assert step["step_s"] == max(step["bytes"] / hw.achieved()["hbm_bytes"],
                                     step["flops"] / hw.achieved()["matmul_flops"])
        assert step["tokens_per_s"] == step["batch"] / step["step_s"]


def test_serve_cli_json():
    done = _plan_cli("--config", "configs/zaya1_8b.py", "--serve", "--hardware", "mi300x", "--context", "4096",
                     "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    plan, = json.loads(done.stdout)["serve"]
    assert plan["hardware"] == "mi300x" and set(plan["formats"]) == {"bfloat16", "int8", "int4"}
    assert plan["formats"]["int4"]["slots"] > plan["formats"]["bfloat16"]["slots"] > 0


@pytest.mark.parametrize("args,fragments", [
    (("--context", "200000"), ("--context 200000", "max_position_embeddings", "fix: a --context from 1 to 131072")),
    (("--context", "131072", "--hardware", "h100", "--device_memory_gb", "8"),
     ("--context 131072: not one request fits on h100 (8 GB", "int4 weights", "fix: --context 34095 or less")),
    (("--memory_reserve", "1.5"), ("--memory_reserve 1.5", "[0, 1)")),
])
def test_serve_cli_errors(args, fragments):
    _assert_user_error(_plan_cli("--config", "configs/zaya1_8b.py", "--serve", *args), *fragments)


def test_decode_flops_are_twice_the_active_weights_plus_scores_and_head():
    """One token (B <= E: one expert row): 2 FLOPs per active non-embedding parameter, QK^T and AV
    over the 4096 held keys of each of the 40 full layers (N = 8 heads of 128), and the tied head 2 D V."""
    per_token = decode_flops_per_token(ZAYA1, 4096, 1)
    scores, head = 2 * 2 * 8 * 128 * 4096 * 40, 2 * 2048 * 262_272
    assert per_token - scores - head == pytest.approx(2 * model_summary(ZAYA1)["params_active_non_embedding"], rel=0.01)
    assert decode_flops_per_token(ZAYA1, 4097, 1) - per_token == 2 * 2 * 8 * 128 * 40
    assert decode_flops_per_token(ZAYA1, 4096, 64) == per_token  # the GPU's ragged dispatch: one row a token
