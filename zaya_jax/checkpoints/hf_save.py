"""Writing a ZayaLM as an HF checkpoint directory, atomically."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

import numpy as np
from flax import nnx

from zaya_jax.config import RUNTIME_MODEL_FIELDS
from zaya_jax.checkpoints.export_check import check_schema, verify_export
from zaya_jax.checkpoints.hf_config import hf_config_from_model
from zaya_jax.checkpoints.hf_load import model_from_tensors
from zaya_jax.checkpoints.hf_names import ENTRIES
from zaya_jax.checkpoints.quantized_export import quantization_config, quantized_tensors
from zaya_jax.checkpoints.safetensors_io import write_sharded
from zaya_jax.errors import UserError
from zaya_jax.model.zaya import ZayaLM


QUANTIZE_METHODS = ("fp8", "mxfp4")


class OutputExistsError(UserError, FileExistsError):
    """The output directory exists and is not empty."""


def group_readable(directory: Path) -> None:
    """Gives a directory made by tempfile.mkdtemp (0700) and its files (safetensors writes 0600) the
    permissions of ones made by a plain mkdir / open (the umask's: usually readable by the group)."""
    umask = os.umask(0)
    os.umask(umask)
    directory.chmod(0o777 & ~umask)
    for path in directory.iterdir():
        path.chmod(0o666 & ~umask)


def hf_tensors(model: ZayaLM, schema: str):
    """Yields (hf_name, np.ndarray float32), converting one tensor at a time."""
    pure = nnx.to_pure_dict(nnx.state(model))
    for entry in ENTRIES[schema](model.config):
        parts = []
        for path, index in entry.targets:
            leaf = pure
            for key in path:
                leaf = leaf[key]
            parts.append(np.asarray(leaf[index], np.float32))
        yield entry.hf_name, entry.to_hf(*parts)


def save_hf(model: ZayaLM, directory: str | os.PathLike, schema: str | None = None,
            max_shard_bytes: int = 5 * 2**30, extra_files: dict[str, str] | None = None,
            report: Callable[[str], None] | None = None, quantize: str | None = None, block: int = 128) -> Path:
    """Writes config.json + safetensors that `transformers.ZayaForCausalLM.from_pretrained` loads.

    schema: "native" (transformers names) or "original" (Zyphra's ZAYA1-base names); by default
    it follows the model's layout. The written files are read back and must compute the same
    model (zaya_jax.checkpoints.export_check); otherwise nothing is written and ExportMismatch says
    why. The directory appears whole or not at all (written to a temporary sibling, checked,
    then renamed); an existing non-empty directory is refused. extra_files: {file name: text}
    written beside them (the tokenizer files, zaya_jax.convert.hf_tokenizer). report: called with
    one line saying what the read-back check compared and found (the convert CLI prints it).
    quantize: None, "fp8" or "mxfp4": written as transformers' quantizers write them, with their
    quantization_config (zaya_jax.checkpoints.quantized_export; fp8 in `block` x `block` blocks, native
    schema only); the read-back check then compares the quantized files, read as quantized, with the
    model holding the written weights' dequantized values.
    """
    cfg = model.config
    schema = schema or ("original" if cfg.layout == "base" else "native")
    if schema not in ENTRIES:
        raise UserError(f"schema={schema!r} does not exist; choose one of {sorted(ENTRIES)}")
    check_schema(model, schema)
    check_quantize(quantize, block, schema)

    def fill(staging: Path) -> str:
        config = {**hf_config_from_model(cfg, schema), "torch_dtype": "float32"}
        tensors, dequantized = hf_tensors(model, schema), {}
        if quantize is not None:
            tensors = quantized_tensors(tensors, quantize, block, dequantized)
            config["quantization_config"] = quantization_config(quantize, block)
        write_sharded(staging, tensors, max_shard_bytes)
        (staging / "config.json").write_text(json.dumps(config, indent=2))
        for name, text in (extra_files or {}).items():
            (staging / name).write_text(text, encoding="utf-8")
        if quantize is None:
            return verify_export(model, staging, schema)
        floats = {name: dequantized.get(name, tensor) for name, tensor in hf_tensors(model, schema)}
        expected = model_from_tensors({k: v for k, v in config.items() if k != "quantization_config"}, set(floats),
                                      floats.__getitem__, "the dequantized export",
                                      **{f: getattr(cfg, f) for f in RUNTIME_MODEL_FIELDS})
        quantized = sorted(dequantized)
        return (verify_export(expected, staging, schema).replace("the source's logits", "the logits of the source "
                                                                 f"holding the {quantize} weights' values")
                + f"; {quantize}: {len(quantized)} tensors quantized")

    return write_whole_directory(directory, fill, report)


def check_quantize(quantize: str | None, block: int, schema: str = "native") -> None:
    """UserError naming the argument unless `quantize` (None or a method) and `block` can be written."""
    if quantize is not None and (quantize not in QUANTIZE_METHODS or schema != "native"):
        raise UserError(f"quantize={quantize!r}: choose one of {list(QUANTIZE_METHODS)}, with the native schema "
                        "(transformers' names: its quantizers' layouts are written for them)")
    if not isinstance(block, int) or isinstance(block, bool) or block < 1:
        raise UserError(f"block={block!r}: the FP8 block size must be a positive integer (transformers' default: 128)")


def write_whole_directory(directory: str | os.PathLike, fill: Callable[[Path], str],
                          report: Callable[[str], None] | None = None) -> Path:
    """Runs fill(staging) in a temporary sibling of `directory` (it writes and checks the files and
    returns what the check found), then renames it into place: the directory appears whole or not
    at all. An existing non-empty directory is refused."""
    target = Path(directory)
    if target.exists() and any(target.iterdir()):
        raise OutputExistsError(f"{target}: exists and is not empty; refusing to overwrite (choose a new directory)")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        checked = fill(staging)
        group_readable(staging)
        if target.exists():
            target.rmdir()
        os.replace(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if report is not None:
        report(checked)
    return target
