"""Loading HF ZAYA checkpoints (transformers layout or Zyphra's original ZAYA1-base names)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from zaya_jax.checkpoints.hf_config import HFCheckpointError, HFFileMissing, model_config_from_hf
from zaya_jax.checkpoints.hf_names import ENTRIES, IGNORED_SUFFIXES, TIED_HEAD, Entry
from zaya_jax.checkpoints.hf_quantized import QuantizedTensors, read_quantization
from zaya_jax.checkpoints.hf_vision_names import vision_entries
from zaya_jax.checkpoints.safetensors_io import TensorReader
from zaya_jax.checkpoints.quantize import BlockScaledArray
from zaya_jax.model.build import abstract_model
from zaya_jax.model.vision.config import VisionConfig
from zaya_jax.model.vision.tower import VisionTower
from zaya_jax.model.zaya import ZayaLM


def read_hf_config(directory: str | os.PathLike) -> dict:
    path = Path(directory) / "config.json"
    if not path.exists():
        if (Path(directory) / "checkpoints").is_dir() or any(p.name.isdigit() for p in Path(directory).glob("*/")):
            raise HFFileMissing(f"{path}: missing; {directory} is a zaya_jax run or checkpoint directory, not an HF "
                                f"export: give it as --checkpoint {directory}")
        raise HFFileMissing(f"{path}: missing (an HF checkpoint directory holds config.json)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise HFCheckpointError(f"{path}: not valid JSON ({err})") from err


def _lookup(tree: dict, path: tuple[str, ...]):
    for key in path:
        tree = tree[key]
    return tree


def check_names(entries: list[Entry], names: set[str], where: str) -> None:
    expected = {e.hf_name for e in entries}
    missing = sorted(expected - names)
    if missing:
        raise HFCheckpointError(f"{where}: missing tensor {missing[0]!r}"
                                + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    unknown = sorted(n for n in names - expected - {TIED_HEAD} if not n.endswith(IGNORED_SUFFIXES))
    if unknown:
        raise HFCheckpointError(f"{where}: unexpected tensor {unknown[0]!r}, not part of this ZAYA config"
                                + (f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""))


def quantized_source(hf: dict, names: set[str], get_tensor, where: str,
                     mxfp4_block_axis: str | None = None) -> QuantizedTensors | None:
    """The checkpoint's tensors as zaya_jax.checkpoints.hf_quantized reads them, when config.json (`hf`)
    has a quantization_config; None otherwise. mxfp4_block_axis: as load_hf's."""
    quant = read_quantization(hf, mxfp4_block_axis=mxfp4_block_axis)
    return None if quant is None else QuantizedTensors(quant, names, get_tensor, where)


def arrays_from_tensors(module_like: nnx.Module, entries: list[Entry], get_tensor, where: str,
                        quantized: QuantizedTensors | None = None, root: tuple[str, ...] = (),
                        ones: tuple[tuple[str, ...], ...] = ()) -> dict:
    """A pure-dict copy of `module_like`'s state filled from HF tensors, one tensor at a time.

    get_tensor(name) -> np.ndarray (float). Returns the nested dict of numpy float32 arrays; with a
    quantized checkpoint (`quantized`), the weights it keeps quantized (hf_quantized's module doc; a
    weight whose every tensor is so stored, under `root`) are BlockScaledArrays of numpy values and
    scales, never expanded to float. `ones`: paths whose entries no tensor may fill, set to 1.
    """
    shapes = {tuple(str(k) for k in path): var.get_value().shape
              for path, var in nnx.to_flat_state(nnx.state(module_like))}
    kept = {path for e in entries if quantized is not None and quantized.kept(e, root) for path, _ in e.targets}
    kept -= {path for e in entries if not (quantized is not None and quantized.kept(e, root)) for path, _ in e.targets}
    arrays = _zeros_like(module_like, skip=kept)
    for path in ones:
        _lookup(arrays, path)[...] = 1.0
    fill_arrays(arrays, [e for e in entries if not kept.intersection(p for p, _ in e.targets)],
                quantized.get if quantized is not None else get_tensor, where)
    stores: dict[tuple[str, ...], tuple[np.ndarray, np.ndarray]] = {}
    for entry in entries:
        if not kept.intersection(p for p, _ in entry.targets):
            continue
        for (path, index), (values, scales) in zip(entry.targets, quantized.stored(entry)):
            lead = shapes[path][:len(index)]
            if path not in stores:
                stores[path] = (np.zeros(lead + values.shape, values.dtype), np.zeros(lead + scales.shape, scales.dtype))
            stores[path][0][index], stores[path][1][index] = values, scales
    for path, (values, scales) in stores.items():
        _lookup(arrays, path[:-1])[path[-1]] = BlockScaledArray(
            values, scales, quantized.quant.method, quantized.transposed_in_memory, shapes[path][values.ndim - 2:],
            quantized.quant.block)
    return arrays


def _zeros_like(module: nnx.Module, skip: set[tuple[str, ...]] = frozenset()) -> dict:
    """The module's state as a pure dict of float32 zeros (None at the paths in `skip`)."""
    def zeros(tree, path=()):
        if isinstance(tree, dict):
            return {k: zeros(v, path + (str(k),)) for k, v in tree.items()}
        return None if path in skip else np.zeros(tree.shape, np.float32)
    return zeros(nnx.to_pure_dict(nnx.state(module)))


def fill_arrays(arrays: dict, entries: list[Entry], get_tensor, where: str) -> dict:
    """Writes each entry's HF tensor (get_tensor(name) -> array, shape-checked) into `arrays`."""
    for entry in entries:
        tensor = get_tensor(entry.hf_name)
        if tuple(tensor.shape) != entry.hf_shape:
            raise HFCheckpointError(f"{where}: tensor {entry.hf_name!r} has shape {tuple(tensor.shape)}, "
                                    f"expected {entry.hf_shape} for this config")
        for (path, index), part in zip(entry.targets, entry.from_hf(np.asarray(tensor, np.float32))):
            _lookup(arrays, path)[index] = part
    return arrays


def model_from_tensors(hf_config: dict, names: set[str], get_tensor, where: str,
                       mxfp4_block_axis: str | None = None, **overrides) -> ZayaLM:
    """Builds a ZayaLM from an HF config dict and a tensor source (get_tensor(name) -> array)."""
    cfg, schema = model_config_from_hf(hf_config, **overrides)
    entries = ENTRIES[schema](cfg)
    quantized = quantized_source(hf_config, names, get_tensor, where, mxfp4_block_axis)
    check_names(entries, quantized.names() if quantized else names, where)
    abstract = abstract_model(cfg)
    # layer 0's router has no state scale in a checkpoint
    arrays = arrays_from_tensors(abstract, entries, get_tensor, where, quantized,
                                 ones=(("layers", "moe", "router", "state_scale"),))
    return _with_arrays(abstract, arrays)


def _with_arrays(module: nnx.Module, arrays: dict):
    graphdef, state = nnx.split(module)
    nnx.replace_by_pure_dict(state, jax.tree.map(jnp.asarray, arrays))
    return nnx.merge(graphdef, state)


def vision_tower_from_tensors(cfg: VisionConfig, get_tensor, prefix: str, where: str) -> VisionTower:
    """A VisionTower whose every parameter comes from the HF tensors named `prefix` + transformers'
    vision-tower names (zaya_jax.checkpoints.hf_vision_names), shape-checked."""
    abstract = nnx.eval_shape(lambda: VisionTower(cfg, rngs=nnx.Rngs(0)))
    return _with_arrays(abstract, arrays_from_tensors(abstract, vision_entries(cfg, prefix), get_tensor, where))


def load_hf(directory: str | os.PathLike, dtype: str = "float32", mxfp4_block_axis: str | None = None,
            **overrides) -> ZayaLM:
    """Reads config.json + safetensors (single or sharded) into a ZayaLM.

    dtype is the compute dtype ("float32" or "bfloat16"); parameters are kept in float32, but for a
    checkpoint transformers' FP8 or MXFP4 quantizer wrote, whose experts and attention projections
    stay in its precision (zaya_jax.checkpoints.hf_quantized).
    mxfp4_block_axis: "output" or "input", the axis an MXFP4 checkpoint's expert blocks run along
    (default: its quantization_config's block_axis, else "output", transformers' reading, said in one line).
    overrides set other ModelConfig fields (moe_backend, scan_layers, ...).
    Every config field and tensor is checked; a mismatch raises an error naming it.
    """
    hf = read_hf_config(directory)
    reader = TensorReader(directory)
    return model_from_tensors(hf, reader.names(), reader.get, str(directory), mxfp4_block_axis, dtype=dtype,
                              **overrides)
