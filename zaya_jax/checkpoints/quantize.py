"""Weight-only int8 / int4 quantization of the experts and the attention projections.

Each selected weight becomes a `QuantizedArray`: integer values plus one float32 scale per
group of `group_size` consecutive entries along the weight's input (contracted) axis,
symmetric, round to nearest:

    scale_g = max_{i in g} |w_i| / qmax       (qmax = 127 for int8, 7 for int4)
    q_i     = round(w_i / scale_g)            w_i ~= q_i * scale_g
int4 values are packed two per byte along the input axis (entry j and entry j + n/2 share
byte j), so the stored bytes are exactly half of int8's. The array stays inside its nnx.Param:
`param[...]` dequantizes to float32 and `.shape` is the original shape, so every model module
runs unchanged. The matmuls run in float on the dequantized weights (unpacking and scaling are
one fused pass): this saves memory and, where decoding is bound by reading weights, time; not
arithmetic. Decoding gathers the chosen experts' integer rows before dequantizing them (`rows`),
so a step only expands the experts it uses.

Quantized (input axis of the per-layer weight, counted from the end so the stacked layer axis
and scan slicing leave it unchanged):
  attention.q_proj, k_proj, v_proj_current, v_proj_delayed  [D, heads, H]   axis -3 (D)
  attention.o_proj                                          [N, H, D]       axis -2 (H; groups stay within a head)
  moe.gate, moe.up [E, D, I]  axis -2 (D);  moe.down [E, I, D]  axis -2 (I)
Kept in float: the tied embedding / output head, the router, the convolutions, norms, scales.

A checkpoint quantized by transformers' FP8 or MXFP4 quantizers loads as `BlockScaledArray`s
(zaya_jax.checkpoints.hf_quantized): its stored values and block scales, dequantized the same way,
inside the jitted computation that reads them.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from zaya_jax.config import ConfigError

QUANTIZED_WEIGHTS = {  # (module, parameter) -> input axis, from the end
    ("attention", "q_proj"): -3, ("attention", "k_proj"): -3, ("attention", "v_proj_current"): -3,
    ("attention", "v_proj_delayed"): -3, ("attention", "o_proj"): -2,
    ("moe", "gate"): -2, ("moe", "up"): -2, ("moe", "down"): -2,
}
MODES = {"int8": 8, "int4": 4}
# e2m1 (fp4) values by 4-bit code: sign in bit 3, then 2 exponent bits and 1 mantissa bit (OCP MX spec)
FP4_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                    np.float32)


class QuantizedWeight:
    """A weight held in fewer bits than float: `param[...]` dequantizes it whole to float32 of `.shape`,
    `take(index)` picks rows of its leading axis still quantized (QuantizedArray, BlockScaledArray)."""

    @property
    def dtype(self):
        return jnp.dtype(jnp.float32)

    def __getitem__(self, index) -> jax.Array:
        if index is not Ellipsis:
            raise IndexError(f"a {type(self).__name__} is read whole (`param[...]`) or by rows (`take`)")
        return self.dequantize()


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedArray(QuantizedWeight):
    """A weight stored as integers with group-wise float32 scales along `axis`.

    values: int8 [..., n, ...] (bits=8) or uint8 [..., n/2, ...] (bits=4: entries j and j + n/2 in byte j)
    scales: float32 [..., n / group, ...]
    """
    values: jax.Array
    scales: jax.Array
    axis: int = dataclasses.field(metadata=dict(static=True))
    bits: int = dataclasses.field(metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        shape = list(self.values.shape)
        shape[self.axis] *= 8 // self.bits
        return tuple(shape)

    def take(self, index: jax.Array) -> "QuantizedArray":
        """Rows `index` (any int array) of the leading, unquantized axis, still quantized."""
        return QuantizedArray(self.values[index], self.scales[index], self.axis, self.bits)

    def dequantize(self) -> jax.Array:
        """-> float32 array of `self.shape`."""
        ints = unpack_int4(self.values, self.axis) if self.bits == 4 else self.values
        axis = self.axis % ints.ndim
        groups = self.scales.shape[axis]
        grouped = ints.reshape(ints.shape[:axis] + (groups, -1) + ints.shape[axis + 1:])
        return (grouped.astype(jnp.float32) * jnp.expand_dims(self.scales, axis + 1)).reshape(ints.shape)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockScaledArray(QuantizedWeight):
    """A weight as a quantized checkpoint stores it: 2-D blocks [..., R, C] with one scale per block.

    fmt "fp8":   values float8_e4m3fn [..., R, C]; scales float32 [..., ceil(R/br), ceil(C/bc)]
                 (transformers' `weight_scale_inv`, a multiplier; [..., 1, 1] for one scale per tensor),
                 block (br, bc), the last block of an axis partial where it does not tile R or C
                 (DeepSeek-V3's layout); block None: the grid tiles the matrix, br = R / its rows
    fmt "mxfp4": values uint8 [..., R, C/2], two e2m1 codes per byte (entry 2j in the low nibble,
                 2j+1 in the high one); scales uint8 [..., R, C/32], e8m0 exponents: 2^(s - 127)
    The stored matrix w[..., r, c] = value * scale of its block; our parameter is w (transposed
    when `transpose`, i.e. swapped last two axes) reshaped to leading axes + `inner`.
    """
    values: jax.Array
    scales: jax.Array
    fmt: str = dataclasses.field(metadata=dict(static=True))
    transpose: bool = dataclasses.field(metadata=dict(static=True))
    inner: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
    block: tuple[int, int] | None = dataclasses.field(default=None, metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.values.shape[:-2]) + tuple(self.inner)

    def take(self, index: jax.Array) -> "BlockScaledArray":
        """Rows `index` of the leading axis, still quantized."""
        return dataclasses.replace(self, values=self.values[index], scales=self.scales[index])

    def stored(self) -> jax.Array:
        """-> float32 [..., R, C], the matrix as stored (before `transpose` / `inner`)."""
        if self.fmt == "mxfp4":
            codes = jnp.stack([self.values & 0xF, self.values >> 4], axis=-1)
            floats = jnp.asarray(FP4_E2M1)[codes.reshape(*self.values.shape[:-1], -1)]
            exponents = self.scales.astype(jnp.int32) - 127
            grouped = floats.reshape(*exponents.shape, -1)
            return jnp.ldexp(grouped, exponents[..., None]).reshape(floats.shape)
        floats = self.values.astype(jnp.float32)
        *lead, rows, cols = floats.shape
        grid_rows, grid_cols = self.scales.shape[-2:]
        block_rows, block_cols = self.block or (rows // grid_rows, cols // grid_cols)
        # partial last blocks: pad to whole ones, scale, crop (no-ops where the blocks tile)
        padded = jnp.pad(floats, [(0, 0)] * len(lead) + [(0, grid_rows * block_rows - rows),
                                                          (0, grid_cols * block_cols - cols)])
        grouped = padded.reshape(*lead, grid_rows, block_rows, grid_cols, block_cols)
        scaled = (grouped * self.scales[..., :, None, :, None]).reshape(padded.shape)
        return scaled[..., :rows, :cols]

    def dequantize(self) -> jax.Array:
        """-> float32 array of `self.shape`."""
        w = self.stored()
        return (jnp.swapaxes(w, -1, -2) if self.transpose else w).reshape(self.shape)


def pack_int4(ints: jax.Array, axis: int) -> jax.Array:
    """int8 in [-8, 7], even length n along `axis` -> uint8 of length n/2: byte j holds entry j
    (low nibble) and entry j + n/2 (high nibble), so unpacking is a concatenation, not a shuffle."""
    half = ints.shape[axis] // 2
    low = jax.lax.slice_in_dim(ints, 0, half, axis=axis).astype(jnp.uint8) & 0xF
    high = jax.lax.slice_in_dim(ints, half, 2 * half, axis=axis).astype(jnp.uint8) << 4
    return low | high


def unpack_int4(packed: jax.Array, axis: int) -> jax.Array:
    """Inverse of pack_int4 -> int8 in [-8, 7], twice as long along `axis`.

    Both halves come from one broadcast [..., 2, n/2, ...]: shift the wanted nibble to the top of
    an int8 (left by 4 for the low half, by 0 for the high half), then sign-extend with an
    arithmetic right shift. Only elementwise ops: XLA fuses them into the consumer well, where a
    concatenation of the two halves would not vectorize.
    """
    ax = axis % packed.ndim
    both = jnp.broadcast_to(jnp.expand_dims(packed, ax), packed.shape[:ax] + (2,) + packed.shape[ax:])
    left = jnp.array([4, 0], jnp.uint8).reshape((2,) + (1,) * (packed.ndim - ax))
    nibbles = jax.lax.bitcast_convert_type(both << left, jnp.int8) >> 4
    return nibbles.reshape(packed.shape[:ax] + (-1,) + packed.shape[ax + 1:])


def group_for(length: int, group_size: int, name: str) -> int:
    group = min(group_size, length)
    if length % group:
        raise ConfigError(f"{name}: input axis of length {length} does not split into groups of {group}; "
                          f"choose a group_size (generate's --group_size) that divides it")
    return group


def quantize_array(w: jax.Array, bits: int, group_size: int, axis: int, name: str = "weight") -> QuantizedArray:
    """w: float [..., n, ...] with the input axis at `axis` (negative) -> QuantizedArray."""
    n = w.shape[axis]
    group = group_for(n, group_size, name)
    if bits == 4 and group % 2:
        raise ValueError(f"{name}: int4 packs pairs, so the group size must be even (got {group})")
    qmax = 2 ** (bits - 1) - 1
    ax = axis % w.ndim
    grouped = w.astype(jnp.float32).reshape(w.shape[:ax] + (n // group, group) + w.shape[ax + 1:])
    scales = jnp.max(jnp.abs(grouped), axis=ax + 1) / qmax
    safe = jnp.where(scales > 0, scales, 1.0)
    ints = jnp.clip(jnp.round(grouped / jnp.expand_dims(safe, ax + 1)), -qmax, qmax).astype(jnp.int8)
    ints = ints.reshape(w.shape)
    values = pack_int4(ints, axis) if bits == 4 else ints
    return QuantizedArray(values, scales, axis, bits)


def quantize_model(model, mode: str, group_size: int = 64):
    """A copy of `model` (a ZayaLM) with its experts and attention projections quantized.

    mode: "int8" | "int4"; group_size: entries per scale along each weight's input axis (the
    whole axis when it is shorter). The input model is left unchanged.
    """
    if mode not in MODES:
        raise ValueError(f"quantize={mode!r} does not exist; choose one of {sorted(MODES)} (or None)")
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive integer, got {group_size!r}")
    bits = MODES[mode]
    graphdef, state = nnx.split(model)
    flat = list(nnx.to_flat_state(state))
    if any(isinstance(var.get_value(), QuantizedWeight) for _, var in flat):
        raise ConfigError(f"quantize={mode!r}: the model's weights are already quantized (a quantized checkpoint's "
                          "FP8 / MXFP4 weights); load it without quantize (--quantize)")
    axes = {i: QUANTIZED_WEIGHTS.get(tuple(path[-2:])) for i, (path, _) in enumerate(flat)}
    chosen = {i: var.get_value() for i, (path, var) in enumerate(flat) if axes[i] is not None and path[0] == "layers"}
    quantized = jax.jit(lambda weights: {
        i: quantize_array(w, bits, group_size, axes[i], ".".join(map(str, flat[i][0]))) for i, w in weights.items()
    })(chosen)  # one compiled program for the whole model instead of op-by-op dispatch
    flat = [(path, var.replace(quantized[i]) if i in quantized else var) for i, (path, var) in enumerate(flat)]
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def dequantize_model(model):
    """`model` (a ZayaLM or ZayaVL) with every quantized weight expanded to float32 (itself when it has none)."""
    graphdef, state = nnx.split(model)
    flat = [(path, var.replace(var.get_value()[...]) if isinstance(var.get_value(), QuantizedWeight) else var)
            for path, var in nnx.to_flat_state(state)]
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def rows(param: nnx.Variable, index: jax.Array, dtype) -> jax.Array:
    """param[index] along its leading axis as `dtype`, gathering before any dequantization."""
    value = param.get_value()
    picked = value.take(index) if isinstance(value, QuantizedWeight) else value[index]
    return picked[...].astype(dtype)


def param_bytes(model) -> int:
    """Bytes held by every array of the model (quantized weights count their integers and scales)."""
    leaves = jax.tree.leaves(nnx.state(model))
    return int(sum(np.dtype(x.dtype).itemsize * x.size for x in leaves))
