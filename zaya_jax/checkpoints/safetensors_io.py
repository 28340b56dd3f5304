"""Streaming safetensors reading and writing: one tensor in memory at a time."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable, Iterator

import ml_dtypes
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from zaya_jax.checkpoints.hf_config import HFCheckpointError, HFFileMissing

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# safetensors' numpy reader has no float8 dtypes (an FP8 checkpoint's weights): these are read from the
# file's bytes as the format lays them out (an 8-byte header length, a JSON header, the data)
FLOAT8 = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}


class TensorReader:
    """Reads tensors by name from `model.safetensors` or a sharded set with an index."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        index = self.directory / INDEX_FILE
        if index.exists():
            try:
                self.file_of = dict(json.loads(index.read_text())["weight_map"])
            except (json.JSONDecodeError, KeyError) as err:
                raise HFCheckpointError(f"{index}: not a safetensors index with a weight_map ({err})") from err
        elif (self.directory / SINGLE_FILE).exists():
            with safe_open(self.directory / SINGLE_FILE, framework="np") as f:
                self.file_of = {name: SINGLE_FILE for name in f.keys()}
        else:
            raise HFFileMissing(f"{self.directory}: no {SINGLE_FILE} or {INDEX_FILE}")
        for name in sorted(set(self.file_of.values())):
            if not (self.directory / name).exists():
                raise FileNotFoundError(f"{self.directory / name}: shard named in {INDEX_FILE} is missing")

    def names(self) -> set[str]:
        return set(self.file_of)

    def get(self, name: str) -> np.ndarray:
        path = self.directory / self.file_of[name]
        with safe_open(path, framework="np") as f:
            if f.get_slice(name).get_dtype() not in FLOAT8:
                return f.get_tensor(name)
        return _float8_tensor(path, name)


def _float8_tensor(path: Path, name: str) -> np.ndarray:
    """A float8 tensor of a safetensors file, as an ml_dtypes array."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        info = json.loads(f.read(size))[name]
        begin, end = info["data_offsets"]
        f.seek(8 + size + begin)
        data = f.read(end - begin)
    return np.frombuffer(data, FLOAT8[info["dtype"]]).reshape(info["shape"])


def write_sharded(directory: Path, tensors: Iterable[tuple[str, np.ndarray]], max_shard_bytes: int) -> None:
    """Writes (name, array) pairs as safetensors shards of at most `max_shard_bytes` (plus an index
    when there is more than one shard). Holds one shard in memory at a time."""
    shards: list[list[str]] = []
    total = 0
    pending: dict[str, np.ndarray] = {}
    pending_bytes = 0

    def flush():
        nonlocal pending, pending_bytes
        if pending:
            save_file(pending, str(directory / f"shard-{len(shards):05d}.safetensors"), metadata={"format": "pt"})
            shards.append(list(pending))
            pending, pending_bytes = {}, 0

    for name, array in _contiguous(tensors):
        if pending and pending_bytes + array.nbytes > max_shard_bytes:
            flush()
        pending[name] = array
        pending_bytes += array.nbytes
        total += array.nbytes
    flush()
    if len(shards) == 1:
        os.replace(directory / "shard-00000.safetensors", directory / SINGLE_FILE)
        return
    weight_map = {}
    for n, names in enumerate(shards):
        final = f"model-{n + 1:05d}-of-{len(shards):05d}.safetensors"
        os.replace(directory / f"shard-{n:05d}.safetensors", directory / final)
        weight_map.update({name: final for name in names})
    (directory / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total},
                                                    "weight_map": weight_map}, indent=2))


def _contiguous(tensors: Iterable[tuple[str, np.ndarray]]) -> Iterator[tuple[str, np.ndarray]]:
    for name, array in tensors:
        yield name, np.ascontiguousarray(array)
