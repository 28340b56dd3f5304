"""The engine on meshes of 8 fake devices (data=2,tensor=2,expert=2 and tensor=2,expert=4), weights
placed by the trainer's rules: the same greedy tokens as the one-device engine for a mixed load with prefix
hits, log-probs within 1e-4 (fp32; the sharded sums add in another order), the weights and the
slots really split, and collectives in the compiled step. A mesh the model cannot use fails first."""

import re

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from tests.model_fixtures import random_tiny_model
from tests.test_engine_serving import MIXED, compilations, run
from zaya_jax.config import ConfigError
from zaya_jax.engine import Engine, SamplingParams
from zaya_jax.engine.step import RowSampling
from zaya_jax.parallel.mesh import make_mesh, parse_mesh_flag

LAYOUT = "data=2,tensor=2,expert=2"
LAYOUTS = [LAYOUT, "tensor=2,expert=4"]  # slots over data; without data they are replicated
SLOTS, CACHE, CHUNK, MAX_TOKENS, TOP = 4, 48, 8, 6, 3
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def model():
    """The engine tests' mixed sliding/full tiny model (4 experts), dropless under all_to_all expert
    parallelism (capacity_factor = num_experts), so the sharded engine computes the same function."""
    return random_tiny_model(**MIXED, capacity_factor=4.0)


def serve(engine: Engine, model) -> list:
    """A mixed load: prompts of 5 to 30 tokens (most past the chunk of 8) arriving over four steps,
    some sharing 1 to 3 blocks with an earlier one (prefix hits) -> each request's Finished."""
    rng = np.random.default_rng(3)
    base = rng.integers(3, model.config.vocab_size, 30).tolist()
    tail = lambda n: rng.integers(3, model.config.vocab_size, n).tolist()  # noqa: E731
    params = SamplingParams(max_tokens=MAX_TOKENS, logprobs=True, top_logprobs=TOP)
    batches = [[(base[:26], params), (tail(5), params)], [], [],
               [(base[:17] + tail(3), params), (tail(20), params), (base + tail(2), params)],
               [(base[:9], params)]]
    return run(engine, batches)


@pytest.fixture(scope="module")
def one_device(model):
    return serve(Engine(model, slots=SLOTS, cache_size=CACHE, chunk=CHUNK, prefix_cache_bytes=1 << 20,
                        max_top_logprobs=TOP), model)


@pytest.fixture(scope="module", params=LAYOUTS)
def sharded(model, request):
    """(the engine on the layout, each request's Finished and events, the compilations while serving
    after warm_up)."""
    engine = Engine(model, slots=SLOTS, cache_size=CACHE, chunk=CHUNK, prefix_cache_bytes=1 << 20,
                    max_top_logprobs=TOP, mesh=make_mesh(parse_mesh_flag(request.param)))
    engine.warm_up()
    with compilations() as compiled:
        done = serve(engine, model)
    return engine, done, compiled


def test_sharded_engine_serves_what_one_device_serves(one_device, sharded):
    engine, done, compiled = sharded
    assert engine.stats()["prefix_hits"] >= 2
    assert compiled == []  # the steps give the state back as it came: nothing recompiles after warm_up
    for (want, want_events), (got, got_events) in zip(one_device, done):
        assert got.tokens == want.tokens and got.reason == want.reason
        np.testing.assert_allclose(got.logprobs, want.logprobs, atol=TOLERANCE, rtol=0)
        for a, b in zip(got_events, want_events):
            assert [t for t, _ in a.top_logprobs] == [t for t, _ in b.top_logprobs]
            np.testing.assert_allclose([lp for _, lp in a.top_logprobs], [lp for _, lp in b.top_logprobs],
                                       atol=TOLERANCE, rtol=0)


def test_weights_and_slots_are_split_and_the_step_has_collectives(sharded):
    engine, _, _ = sharded
    moe, attention = engine._params["layers"]["moe"], engine._params["layers"]["attention"]
    assert moe["gate"].get_value().sharding.spec == P(None, "expert", None, "tensor")
    assert attention["k_proj"].get_value().sharding.spec == P(None, None, "tensor", None)
    if engine.mesh.shape["data"] > 1:  # still after restores and steps
        assert engine._state.keys.sharding.spec == P(None, "data") and engine._state.lengths.sharding.spec == P("data")
    else:
        assert engine._state.keys.sharding.is_fully_replicated and engine._state.lengths.sharding.is_fully_replicated
    assert len(engine._state.keys.sharding.device_set) == 8
    zeros = np.zeros(SLOTS, np.int32)
    rows = RowSampling(np.zeros(SLOTS, np.float32), zeros, np.ones(SLOTS, np.float32), zeros.astype(np.uint32), zeros,
                       zeros)
    hlo = engine._chunk.lower(engine._graphdef, engine._params, engine._state, None, zeros,
                              np.zeros((SLOTS, CHUNK), np.int32), zeros, rows, zeros, zeros, rows,
                              top=TOP).compile().as_text()
    # the MoE's own sharded dispatch (moe_sharding: a shard_map, only under the engine's mesh), not
    # just the partitioner's resharding of sharded weights (which has all-to-alls and all-reduces too)
    found = collectives(hlo)
    assert any(op == "all-to-all" and "experts/shard_map/all_to_all" in name for op, name in found)  # expert
    assert any(op == "all-reduce" and "experts/shard_map/psum" in name for op, name in found)  # tensor=2


def collectives(hlo: str) -> list[tuple[str, str]]:
    """(op, the op_name of the jax op it came from) of each collective in compiled HLO text."""
    return re.findall(r"= .*? (all-to-all|all-reduce|all-gather|reduce-scatter)\(.*?op_name=\"([^\"]*)\"", hlo)


@pytest.mark.parametrize("layout,slots,message", [
    ("data=2,tensor=4", 4, r"tensor=4 does not divide qk_heads = 6 .*\nfix: a mesh of data=2,tensor=2"),
    (LAYOUT, 3, r"slots=3 does not split over data=2 x expert=2 = 4, .*\nfix: slots a multiple of 4, e.g. 4"),
    ("data=4,context=2", 4, r"context=2: .*\nfix: a mesh of data=4 "),
])
def test_a_mesh_the_engine_cannot_use_is_named_before_anything_compiles(model, layout, slots, message):
    with pytest.raises(ConfigError, match=message):
        Engine(model, slots=slots, cache_size=CACHE, chunk=CHUNK, mesh=make_mesh(parse_mesh_flag(layout)))


@pytest.mark.parametrize("mode", ["int8", "int4", "fp8"])
def test_a_quantized_model_on_a_mesh_serves_what_it_serves_on_one_device(model, mode, tmp_path):
    """int8 / int4 weights, or an FP8 checkpoint's blocks, placed on data=2,tensor=2,expert=2: the
    experts' stored arrays split over `expert` (int8 / int4 over `tensor` too, as the float weight's:
    their groups run along the model width), the greedy tokens of the quantized model on one device,
    log-probs within the sharded tolerance."""
    import zaya_jax
    from zaya_jax.checkpoints.quantize import BlockScaledArray, QuantizedArray, quantize_model
    if mode == "fp8":
        source = random_tiny_model(**MIXED, capacity_factor=4.0, moe_intermediate_size=32, layout="native",
                                   router_norm_eps=1e-5, residual_in_fp32=True)
        zaya_jax.save_hf(source, tmp_path / mode, quantize=mode, block=8)
        quantized = zaya_jax.load_hf(tmp_path / mode, capacity_factor=4.0)
    else:
        quantized = quantize_model(model, mode, 16)
    want = serve(Engine(quantized, slots=SLOTS, cache_size=CACHE, chunk=CHUNK, prefix_cache_bytes=1 << 20,
                        max_top_logprobs=TOP), quantized)
    engine = Engine(quantized, slots=SLOTS, cache_size=CACHE, chunk=CHUNK, prefix_cache_bytes=1 << 20,
                    max_top_logprobs=TOP, mesh=make_mesh(parse_mesh_flag(LAYOUT)))
    gate = engine._params["layers"]["moe"]["gate"].get_value()
    assert isinstance(gate, BlockScaledArray if mode == "fp8" else QuantizedArray)
    assert gate.scales.sharding.spec[1] == "expert"
    assert gate.values.sharding.spec == P(None, "expert", None, None if mode == "fp8" else "tensor")
    for (w, _), (g, _) in zip(want, serve(engine, quantized)):
        assert g.tokens == w.tokens and g.reason == w.reason
        np.testing.assert_allclose(g.logprobs, w.logprobs, atol=TOLERANCE, rtol=0)
