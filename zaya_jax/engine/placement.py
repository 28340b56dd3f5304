"""The engine on a device mesh, its weights placed as the trainer places them.

Weights: `zaya_jax.parallel.rules.state_specs`, the trainer's logical-axis rules: tensor > 1
splits the heads, the vocabulary and each expert's hidden size; expert > 1 the experts; fsdp > 1
the model width (each gathered where a layer needs it). A quantized weight (int8 / int4, FP8 /
MXFP4 blocks) is split as its float weight would be along the axes its stored arrays keep whole
(the layer and expert axes, and for int8 every axis its values keep), the rest replicated
(`quantized_spec`): expert parallelism splits a quantized model's experts as a float one's. Decode state (N slots): every leaf's slot
dimension (dim 1 of the [L,N,...] caches and carry, dim 0 of lengths [N]) over `data`, replicated
over the other axes. The compiled calls (engine_chunk, engine_decode, the prefix cache's snapshot
and restore, a ZayaVL's image prefill) are jitted with those shardings as outputs (an entry:
replicated), so each call's state comes back as it went in and nothing recompiles, and run
under `jax.set_mesh(mesh)`, so the MoE dispatch (zaya_jax.parallel.moe_sharding: a shard_map over
the batch axes data, fsdp, expert) and the rest of the model trace for the mesh. The host loop
does not change.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, NamedTuple

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from zaya_jax.config import ConfigError
from zaya_jax.engine.buckets import doubling_buckets
from zaya_jax.engine.images import IMAGES_JIT, prefill_with_images_fn
from zaya_jax.engine.prefix_cache import RESTORE_JIT, SNAPSHOT_JIT, restore_fn, snapshot_fn
from zaya_jax.engine.step import CHUNK_JIT, DECODE_JIT, chunk_fn, decode_fn
from zaya_jax.infer.cache import DecodeState
from zaya_jax.checkpoints.quantize import QuantizedArray, QuantizedWeight
from zaya_jax.model.vision.vl import text_model
from zaya_jax.parallel.context import active_axes
from zaya_jax.parallel.mesh import MESH_AXES, check_platform_support
from zaya_jax.parallel.rules import RULES, check_axes_divide, state_specs


def mesh_text(shape: dict[str, int]) -> str:
    """{axis: size} -> 'tensor=2,expert=4' (the --mesh syntax; axes of size 1 left out, 'one device' if all are)."""
    return ",".join(f"{a}={shape[a]}" for a in MESH_AXES if shape.get(a, 1) > 1) or "one device"


def check_mesh(model: nnx.Module, shape: dict[str, int], slots: int, where: str = "Engine(mesh=...)",
               fix: Callable[[str, int], str] | None = None) -> None:
    """A ConfigError naming the axis and the fix, before anything compiles, when the engine cannot
    run `model` with `slots` rows on a mesh of `shape` {axis: size}: an axis that does not divide a
    weight dimension it shards (the trainer's check, rules.check_axes_divide), context > 1, slots not
    a multiple of the batch axes' product, or an expert exchange the platform lacks.
    `fix(axis, size)` words the fix for a mesh with that axis changed (default: the mesh's sizes)."""
    fix = fix or (lambda axis, size: f"a mesh of {mesh_text({**shape, axis: size})}")
    if shape.get("context", 1) > 1:
        raise ConfigError(f"{where}: context={shape['context']}: an engine step's chunk (one token when decoding) "
                          f"is not split over context\nfix: {fix('context', 1)} (those devices on data or tensor)")
    check_axes_divide([nnx.state(model)], shape, where, fix)
    batch = active_axes(RULES["batch"], shape)
    rows = math.prod(shape[a] for a in batch)
    if slots % rows:
        raise ConfigError(f"{where}: slots={slots} does not split over {' x '.join(f'{a}={shape[a]}' for a in batch)}"
                          f" = {rows}, the axes the MoE splits an engine step's rows over\nfix: slots a multiple "
                          f"of {rows}, e.g. {-(-slots // rows) * rows}")
    check_platform_support(shape, text_model(model).config.expert_parallel)


def row_buckets(slots: int, mesh: Mesh | None) -> tuple[int, ...]:
    """The row counts a prefill chunk call may take: m, 2m, 4m, ... below `slots`, then `slots`,
    where m is the product of the batch axes the MoE splits rows over (1 without a mesh;
    check_mesh made it divide slots)."""
    m = 1 if mesh is None else math.prod(mesh.shape[a] for a in active_axes(RULES["batch"], dict(mesh.shape)))
    return doubling_buckets(m, slots)


def slot_shardings(state: DecodeState, mesh: Mesh) -> DecodeState:
    """The decode state's NamedShardings: the slot dimension over `data` (check_mesh made it divide
    it), the rest replicated; without a data axis, all replicated."""
    data = "data" if mesh.shape.get("data", 1) > 1 else None
    sharding = functools.partial(NamedSharding, mesh)
    leading = jax.tree.map(lambda x: sharding(P(None, data)), state._replace(lengths=None))
    return leading._replace(lengths=sharding(P(data)))


class Placed(NamedTuple):
    """An engine's weights and state placed on a mesh, and its compiled calls jitted for them."""
    params: nnx.State
    state: DecodeState
    chunk: Callable      # engine_chunk's signature
    decode: Callable     # engine_decode's
    snapshot: Callable   # prefix_cache.snapshot's
    restore: Callable    # prefix_cache.restore's
    images: Callable     # images.prefill_with_images's


def place(model: nnx.Module, params: nnx.State, state: DecodeState, mesh: Mesh, slots: int) -> Placed:
    """params (nnx.split's state of model, or of a ZayaVL's text model) by the trainer's rules, state
    [.., N, ..] by slot_shardings, and engine_chunk, engine_decode, snapshot, restore and the image
    prefill jitted with those output shardings, each called under jax.set_mesh(mesh). check_mesh
    first (a ZayaVL's tower included): a mesh the model cannot use fails before anything moves."""
    check_mesh(model, dict(mesh.shape), slots)
    state_sharding, replicated = slot_shardings(state, mesh), NamedSharding(mesh, P())
    return Placed(place_params(params, mesh), jax.device_put(state, state_sharding),
                  on_mesh(jax.jit(chunk_fn, **CHUNK_JIT, out_shardings=(state_sharding, replicated, replicated)), mesh),
                  on_mesh(jax.jit(decode_fn, **DECODE_JIT, out_shardings=(state_sharding, replicated)), mesh),
                  on_mesh(jax.jit(snapshot_fn, **SNAPSHOT_JIT, out_shardings=replicated), mesh),
                  on_mesh(jax.jit(restore_fn, **RESTORE_JIT, out_shardings=state_sharding), mesh),
                  on_mesh(jax.jit(prefill_with_images_fn, **IMAGES_JIT, out_shardings=(state_sharding, replicated)),
                          mesh))


def place_params(params: nnx.State, mesh: Mesh) -> nnx.State:
    """Weights (nnx.split(model)'s state) on `mesh` by the trainer's rules (Engine.set_weights
    places new weights so too: the compiled calls take them as they took the first)."""
    specs = dict(nnx.to_flat_state(state_specs(params, mesh)))
    placed = []
    for path, var in nnx.to_flat_state(params):
        spec, value = specs[path].get_value(), var.get_value()
        if isinstance(value, QuantizedWeight):
            spec = quantized_spec(value, spec, dict(mesh.shape))
        placed.append((path, var.replace(jax.tree.map(lambda s: NamedSharding(mesh, s), spec,
                                                      is_leaf=lambda x: isinstance(x, P)))))
    return jax.device_put(params, nnx.from_flat_state(placed))


def quantized_spec(weight: QuantizedWeight, spec: P, mesh_shape: dict[str, int]) -> QuantizedWeight:
    """The PartitionSpecs of a quantized weight's stored arrays, as `weight` (a pytree of P): each
    dimension the array shares with the float weight (its leading ones: all of an int8 array's, all
    but the block matrix of a block-scaled one's) takes the float weight's entry where that divides
    it; the others are replicated."""
    shape = weight.shape
    entries = list(spec) + [None] * (len(shape) - len(spec))
    shared = len(shape) if isinstance(weight, QuantizedArray) else weight.values.ndim - 2

    def one(array) -> P:
        out = []
        for d, size in enumerate(array.shape):
            entry = entries[d] if d < shared and size == shape[d] else None
            axes = (entry,) if isinstance(entry, str) else tuple(entry or ())
            out.append(entry if size % math.prod(mesh_shape[a] for a in axes) == 0 else None)
        return P(*out)
    return dataclasses.replace(weight, values=one(weight.values), scales=one(weight.scales))


def on_mesh(jitted: Callable, mesh: Mesh) -> Callable:
    """A jitted function called under jax.set_mesh(mesh) (the mesh the model's shard_maps and
    constraints read), and its `.lower` (for the compiled program's HLO) too."""
    def under_mesh(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def call(*args, **kwargs):
            with jax.set_mesh(mesh):
                return fn(*args, **kwargs)
        return call
    call = under_mesh(jitted)
    call.lower = under_mesh(jitted.lower)
    return call
