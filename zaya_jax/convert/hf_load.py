"""Loading HF ZAYA checkpoints (transformers layout or Zyphra's original ZAYA1-base names)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from zaya_jax.convert.hf_config import HFCheckpointError, HFFileMissing, model_config_from_hf
from zaya_jax.convert.hf_names import ENTRIES, IGNORED_SUFFIXES, TIED_HEAD, Entry
from zaya_jax.convert.hf_vision_names import vision_entries
from zaya_jax.convert.safetensors_io import TensorReader
from zaya_jax.model.build import abstract_model
from zaya_jax.model.zaya import ZayaLM
from zaya_jax.vision.config import VisionConfig
from zaya_jax.vision.tower import VisionTower


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


def params_from_tensors(model_like: ZayaLM, entries: list[Entry], get_tensor, where: str) -> dict:
    """Fills a pure-dict copy of `model_like`'s state from HF tensors, one tensor at a time.

    get_tensor(name) -> np.ndarray. Returns the nested dict of numpy float32 arrays.
    """
    arrays = _zeros_like(model_like)
    arrays["layers"]["moe"]["router"]["state_scale"][...] = 1.0  # layer 0 has none in a checkpoint
    return fill_arrays(arrays, entries, get_tensor, where)


def _zeros_like(module: nnx.Module) -> dict:
    return jax.tree.map(lambda a: np.zeros(a.shape, np.float32), nnx.to_pure_dict(nnx.state(module)))


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


def model_from_tensors(hf_config: dict, names: set[str], get_tensor, where: str, **overrides) -> ZayaLM:
    """Builds a ZayaLM from an HF config dict and a tensor source (get_tensor(name) -> array)."""
    cfg, schema = model_config_from_hf(hf_config, **overrides)
    entries = ENTRIES[schema](cfg)
    check_names(entries, names, where)
    abstract = abstract_model(cfg)
    arrays = params_from_tensors(abstract, entries, get_tensor, where)
    return _with_arrays(abstract, arrays)


def _with_arrays(module: nnx.Module, arrays: dict):
    graphdef, state = nnx.split(module)
    nnx.replace_by_pure_dict(state, jax.tree.map(jnp.asarray, arrays))
    return nnx.merge(graphdef, state)


def vision_tower_from_tensors(cfg: VisionConfig, get_tensor, prefix: str, where: str) -> VisionTower:
    """A VisionTower whose every parameter comes from the HF tensors named `prefix` + transformers'
    vision-tower names (zaya_jax.convert.hf_vision_names), shape-checked."""
    abstract = nnx.eval_shape(lambda: VisionTower(cfg, rngs=nnx.Rngs(0)))
    return _with_arrays(abstract, fill_arrays(_zeros_like(abstract), vision_entries(cfg, prefix), get_tensor, where))


def load_hf(directory: str | os.PathLike, dtype: str = "float32", **overrides) -> ZayaLM:
    """Reads config.json + safetensors (single or sharded) into a ZayaLM.

    dtype is the compute dtype ("float32" or "bfloat16"); parameters are kept in float32.
    overrides set other ModelConfig fields (moe_backend, scan_layers, ...).
    Every config field and tensor is checked; a mismatch raises an error naming it.
    """
    hf = read_hf_config(directory)
    reader = TensorReader(directory)
    return model_from_tensors(hf, reader.names(), reader.get, str(directory), dtype=dtype, **overrides)
