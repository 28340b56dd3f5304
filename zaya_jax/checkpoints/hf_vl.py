"""transformers' ZAYA1-VL checkpoints (`Zaya1VLForConditionalGeneration`, model_type "zaya1_vl"):
config and tensor names, onto zaya_jax.model.vision.vl.ZayaVL.

config.json holds `text_config` (a ZAYA text config plus `vision_lora`, `vision_lora_rank_attn`,
`vision_lora_rank_mlp`), `vision_config` (Qwen2.5-VL's vision tower) and the image token ids.
Tensors: the text model's under `model.language_model.` (transformers' ZAYA names, but the final
norm is `final_norm` and the router's norm `rmsnorm_eda`), its vision LoRA beside the projections it
adapts (`self_attn.qkv_proj.{q,k,v_current,v_delayed}_lora_{a,b}`, `self_attn.o_lora_{a,b}`,
`mlp.experts.lora_{gate_up,down}_proj_{a,b}`), the vision tower's under `model.visual.`.
The image processor's settings are preprocessor_config.json (zaya_jax.checkpoints.hf_image_processor).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np
from flax import nnx

from zaya_jax.config import RUNTIME_MODEL_FIELDS, ModelConfig
from zaya_jax.checkpoints.export_check import ExportMismatch, check_schema, compare_probe_logits
from zaya_jax.checkpoints.hf_config import (PRETRAINED_FIELDS, ZAYA_FIELDS, HFCheckpointError, _native_to_model,
                                        check_fixed, fixed, hf_config_from_model, inert, read)
from zaya_jax.checkpoints.hf_image_processor import (PREPROCESSOR_CONFIG, compare_image_processors, preprocessor_config,
                                                 read_image_processor)
from zaya_jax.checkpoints.hf_load import (_lookup, _with_arrays, arrays_from_tensors, check_names, quantized_source,
                                      read_hf_config)
from zaya_jax.checkpoints.hf_save import check_quantize, write_whole_directory
from zaya_jax.checkpoints.hf_names import _SWAP, Entry, _Builder, _swiglu_split, native_entries
from zaya_jax.checkpoints.hf_vision_names import vision_entries
from zaya_jax.checkpoints.quantized_export import quantization_config, quantized_tensors
from zaya_jax.checkpoints.safetensors_io import TensorReader, write_sharded
from zaya_jax.model.vision.config import VisionConfig
from zaya_jax.model.vision.layout import patch_layout
from zaya_jax.model.vision.vl import ZAYA1_VL_IDS, ImageBatch, ImageTokenIds, ZayaVL
from zaya_jax.data.vision.processor import ImageProcessor

TEXT_PREFIX, VISION_PREFIX = "model.language_model.", "model.visual."

# How each field of transformers' zaya1_vl config classes is taken (hf_config.Field; main branch at
# b53060f, models/zaya1_vl/configuration_zaya1_vl.py): Zaya1VLConfig, its text_config (ZayaConfig's
# fields and the vision LoRA's) and its vision_config (the Qwen2.5-VL tower's)
ZAYA1_VL_FIELDS = {
    **PRETRAINED_FIELDS,
    "text_config": read("the text ModelConfig (ZAYA1_VL_TEXT_FIELDS)"),
    "vision_config": read("VisionConfig (ZAYA1_VL_VISION_FIELDS)"),
    "image_token_id": read("ImageTokenIds.image"), "vision_start_token_id": read("ImageTokenIds.vision_start"),
    "vision_end_token_id": read("ImageTokenIds.vision_end"),
    "tie_word_embeddings": fixed((True,), True),  # lm_head is the text embedding (ZAYA ties them)
    "output_router_logits": inert("returns the router logits; no loss is added from them"),
}
ZAYA1_VL_TEXT_FIELDS = {**ZAYA_FIELDS, "vision_lora": read("vision_lora_rank_attn, vision_lora_rank_mlp (0: none)"),
                        "vision_lora_rank_attn": read("vision_lora_rank_attn"),
                        "vision_lora_rank_mlp": read("vision_lora_rank_mlp")}
ZAYA1_VL_VISION_FIELDS = {
    **PRETRAINED_FIELDS,
    **{name: read(name) for name in ("depth", "hidden_size", "intermediate_size", "num_heads", "in_channels",
                                     "patch_size", "spatial_merge_size", "temporal_patch_size", "window_size",
                                     "out_hidden_size", "fullatt_block_indexes")},
    "hidden_act": fixed(("silu",), "silu"),
    "tokens_per_second": inert("kept by the vision model, never read (text positions are 1D)"),
    "initializer_range": inert("weight init; a checkpoint holds every weight"),
}


def vl_configs_from_hf(hf: dict[str, Any], **overrides) -> tuple[ModelConfig, VisionConfig, ImageTokenIds]:
    """config.json of a zaya1_vl checkpoint -> (text ModelConfig, VisionConfig, image token ids);
    overrides set the text model's runtime fields (dtype, moe_backend, ...), dtype also the tower's.
    A field fixed by the tables above to other values is refused naming it."""
    if hf.get("model_type") != "zaya1_vl":
        raise HFCheckpointError(f"config.json: model_type is {hf.get('model_type')!r}, expected 'zaya1_vl'")
    text, vision = hf.get("text_config") or {}, hf.get("vision_config") or {}
    if not text or not vision:
        raise HFCheckpointError("config.json: a zaya1_vl config holds text_config and vision_config")
    check_fixed(hf, ZAYA1_VL_FIELDS)
    check_fixed(vision, ZAYA1_VL_VISION_FIELDS, "vision_config.")
    tower_rope = (vision.get("rope_parameters") or {}).get("rope_theta", VisionConfig.rope_theta)
    if tower_rope != VisionConfig.rope_theta:
        raise HFCheckpointError(f"config.json: vision_config.rope_parameters.rope_theta={tower_rope!r}: transformers' "
                                f"zaya1_vl tower has no such setting and rotates with {VisionConfig.rope_theta:g}; "
                                "remove it")
    lora = bool(text.get("vision_lora", True))
    text_cfg = ModelConfig(**{**_native_to_model(text, ZAYA1_VL_TEXT_FIELDS, "text_config."),
                              "vision_lora_rank_attn": text.get("vision_lora_rank_attn", 8) if lora else 0,
                              "vision_lora_rank_mlp": text.get("vision_lora_rank_mlp", 32) if lora else 0,
                              **overrides})
    vision_cfg = VisionConfig.from_hf(vision, dtype=text_cfg.dtype)
    ids = ImageTokenIds(hf.get("image_token_id", ZAYA1_VL_IDS.image),
                        hf.get("vision_start_token_id", ZAYA1_VL_IDS.vision_start),
                        hf.get("vision_end_token_id", ZAYA1_VL_IDS.vision_end))
    return text_cfg, vision_cfg, ids


def _text_name(name: str) -> str:
    """transformers' ZAYA text name -> its name inside a zaya1_vl checkpoint."""
    name = name.replace("model.", TEXT_PREFIX, 1)
    name = TEXT_PREFIX + "final_norm.weight" if name == TEXT_PREFIX + "norm.weight" else name
    return name.replace(".router_mlp.norm.weight", ".router_mlp.rmsnorm_eda.weight")


def _under(root: str, entries: list[Entry], rename=lambda name: name) -> list[Entry]:
    """The same entries with their targets under ZayaVL's `root` submodule (and renamed)."""
    return [Entry(rename(e.hf_name), e.hf_shape, tuple(((root,) + path, ix) for path, ix in e.targets), e.from_hf,
                  e.to_hf) for e in entries]


def _lora_linear(out_dims: tuple[int, ...]):
    """LoRA up-projection: torch Linear weight [out, r] <-> ours [r, *out_dims]."""
    return (lambda w: (w.T.reshape(w.shape[1], *out_dims),), lambda x: x.reshape(x.shape[0], -1).T)


def _lora_entries(b: _Builder, cfg: ModelConfig, i: int) -> None:
    d, n, k, h = cfg.hidden_size, cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim
    r, rm, i_size = cfg.vision_lora_rank_attn, cfg.vision_lora_rank_mlp, cfg.moe_intermediate_size
    p = f"{TEXT_PREFIX}layers.{i}."
    att = ("layers", "attention", "vision_lora")  # paths inside ZayaLM
    transpose = (lambda w: (w.T,), lambda x: x.T)
    if r:
        for ours, theirs, heads in (("q", "q", n), ("k", "k", k), ("v_current", "v_current", k // 2),
                                    ("v_delayed", "v_delayed", k // 2)):
            name = f"{p}self_attn.qkv_proj.{theirs}_lora_"
            b.add(name + "a.weight", (r, d), att + (ours + "_a",), (i,), transpose)
            b.add(name + "b.weight", (heads * h, r), att + (ours + "_b",), (i,), _lora_linear((heads, h)))
        b.add(p + "self_attn.o_lora_a.weight", (r, n * h), att + ("o_a",), (i,),
              (lambda w: (w.T.reshape(n, h, r),), lambda x: x.reshape(-1, r).T))
        b.add(p + "self_attn.o_lora_b.weight", (d, r), att + ("o_b",), (i,), transpose)
    if rm:
        e, moe = cfg.num_experts, ("layers", "moe", "vision_lora")
        ex = p + "mlp.experts.lora_"
        b.add(ex + "gate_up_proj_a", (e, rm, d), moe + ("gate_up_a",), (i,), _SWAP)
        b.add_multi(ex + "gate_up_proj_b", (e, 2 * i_size, rm), ((moe + ("gate_b",), (i,)), (moe + ("up_b",), (i,))),
                    *_swiglu_split(i_size))
        b.add(ex + "down_proj_a", (e, rm, i_size), moe + ("down_a",), (i,), _SWAP)
        b.add(ex + "down_proj_b", (e, d, rm), moe + ("down_b",), (i,), _SWAP)


def vl_entries(text: ModelConfig, vision: VisionConfig) -> list[Entry]:
    """Every HF tensor of a zaya1_vl checkpoint; targets are paths in ZayaVL ("text" / "vision" first)."""
    lora = _Builder()
    for i in range(text.num_layers):
        _lora_entries(lora, text, i)
    return (_under("text", native_entries(text), _text_name) + _under("text", lora.entries)
            + _under("vision", vision_entries(vision, VISION_PREFIX)))


def vl_model_from_tensors(hf: dict[str, Any], names: set[str], get_tensor, where: str,
                          mxfp4_block_axis: str | None = None, **overrides) -> ZayaVL:
    """A ZayaVL from a zaya1_vl config dict and a tensor source (get_tensor(name) -> array), every
    tensor named and shape-checked. mxfp4_block_axis: as load_hf's."""
    text, vision, ids = vl_configs_from_hf(hf, **overrides)
    entries = vl_entries(text, vision)
    quantized = quantized_source(hf, names, get_tensor, where, mxfp4_block_axis)
    check_names(entries, quantized.names() if quantized else names, where)
    abstract = nnx.eval_shape(lambda: ZayaVL(text, vision, ids, rngs=nnx.Rngs(0)))
    # layer 0's router has no state scale in a checkpoint
    return _with_arrays(abstract, arrays_from_tensors(abstract, entries, get_tensor, where, quantized, root=("text",),
                                                      ones=(("text", "layers", "moe", "router", "state_scale"),)))


def hf_vl_config(model: ZayaVL) -> dict[str, Any]:
    """config.json of a zaya1_vl checkpoint for `model` (transformers' Zaya1VLConfig keys)."""
    text, vision, ids = model.text.config, model.vision.config, model.ids
    text_hf = {**hf_config_from_model(text, "native"), "model_type": "zaya1_vl_text",
               "vision_lora": bool(text.vision_lora_rank_attn or text.vision_lora_rank_mlp),
               "vision_lora_rank_attn": text.vision_lora_rank_attn, "vision_lora_rank_mlp": text.vision_lora_rank_mlp}
    text_hf.pop("architectures", None)
    vision_hf = {"model_type": "zaya1_vl_vision", **{f.name: getattr(vision, f.name) for f in dataclasses.fields(vision)
                                                      if f.name not in ("rope_theta", "rms_norm_eps", "dtype")}}
    vision_hf["fullatt_block_indexes"] = list(vision.fullatt_block_indexes)
    return {"model_type": "zaya1_vl", "architectures": ["Zaya1VLForConditionalGeneration"], "text_config": text_hf,
            "vision_config": vision_hf, "image_token_id": ids.image, "vision_start_token_id": ids.vision_start,
            "vision_end_token_id": ids.vision_end, "tie_word_embeddings": True, "torch_dtype": "float32"}


def load_vl_hf(directory: str | os.PathLike, dtype: str = "float32", mxfp4_block_axis: str | None = None,
               **overrides) -> ZayaVL:
    """Reads a zaya1_vl checkpoint directory (config.json + safetensors) into a ZayaVL
    (mxfp4_block_axis: as load_hf's)."""
    reader = TensorReader(directory)
    return vl_model_from_tensors(read_hf_config(directory), reader.names(), reader.get, str(directory),
                                 mxfp4_block_axis, dtype=dtype, **overrides)


def _stderr_line(line: str) -> None:
    print(line, file=sys.stderr)


def load_vl_processor(directory: str | os.PathLike, report: Callable[[str], None] = _stderr_line) -> ImageProcessor:
    """The image processor of a zaya1_vl checkpoint directory (its preprocessor_config.json; without
    one, transformers' default sizes, said through `report` in one line): what its images are resized
    and cut with (pass it to generate's image_processor)."""
    _, vision, _ = vl_configs_from_hf(read_hf_config(directory))
    return read_image_processor(directory, vision, report)


def _probe(model: ZayaVL) -> tuple[np.ndarray, ImageBatch]:
    """[1, 24] ids holding one image of 2x2 merged tokens, and its patches (fixed random pixels)."""
    cfg, ids = model.vision.config, model.ids
    m = cfg.spatial_merge_size
    grid = (1, 2 * m, 2 * m)
    rng = np.random.default_rng(0)
    text = list(rng.integers(3, min(ids.image, ids.vision_start, ids.vision_end, model.text.config.vocab_size), 24))
    span = [ids.vision_start] + [ids.image] * 4 + [ids.vision_end]
    layout = patch_layout([grid], cfg)
    patches = rng.normal(size=(4 * m * m, cfg.patch_dim)).astype(np.float32)
    batch = ImageBatch(*(np.asarray(a)[None] for a in (patches, *layout[:3])))
    return np.asarray([text[:4] + span + text[4:4 + 24 - 4 - len(span)]]), batch


def verify_vl_export(model: ZayaVL, directory: Path, processor: ImageProcessor) -> str:
    """The written files, read back, give the source's configs, its logits on a probe batch with
    an image, and its image processor's patches and image tokens; returns what was checked, as one line."""
    runtime = {f: getattr(model.text.config, f) for f in RUNTIME_MODEL_FIELDS}
    written = load_vl_hf(directory, **runtime)
    expected_text = model.text.config.replace(layout="native")
    if written.text.config != expected_text or written.vision.config != model.vision.config or written.ids != model.ids:
        raise ExportMismatch("the zaya1_vl export reads back with a different config than its source; nothing was "
                             "written")
    ids, images = _probe(model)
    forward = nnx.jit(lambda m, x, im: m(x, im))
    found = compare_probe_logits(forward(model, ids, images), forward(written, ids, images), "the zaya1_vl export",
                                 "a probe batch with an image")
    processed = compare_image_processors(processor, load_vl_processor(directory, report=lambda line: None))
    return (f"checked: the zaya1_vl export read back gives the source's configs and logits on a probe batch with "
            f"an image ({found}), and {processed}")


def vl_tensors(model: ZayaVL):
    """Yields (hf_name, np.ndarray float32), one tensor at a time."""
    pure = nnx.to_pure_dict(nnx.state(model))
    for entry in vl_entries(model.text.config, model.vision.config):
        yield entry.hf_name, entry.to_hf(*(np.asarray(_lookup(pure, path)[index], np.float32)
                                           for path, index in entry.targets))


def save_vl_hf(model: ZayaVL, directory: str | os.PathLike, max_shard_bytes: int = 5 * 2**30,
               report: Callable[[str], None] | None = None, extra_files: dict[str, str] | None = None,
               processor: ImageProcessor | None = None, quantize: str | None = None, block: int = 128) -> Path:
    """Writes a zaya1_vl checkpoint (transformers' `Zaya1VLForConditionalGeneration` layout) with its
    image processor's preprocessor_config.json (`processor`: the run's, whose sizes its images were
    prepared with; default: Qwen2-VL's sizes on the tower's patches), checked on write and whole or
    absent, as save_hf does for the text model (extra_files: its {file name: text} beside them, the
    tokenizer's). quantize "fp8" / "mxfp4": the text model's weights quantized as save_hf writes them
    (zaya_jax.checkpoints.quantized_export), the vision tower, merger and LoRA in float; the read-back
    check then compares with the model holding the written weights' dequantized values."""
    check_schema(model.text, "native")
    check_quantize(quantize, block)
    processor = processor or ImageProcessor.for_tower(model.vision.config)

    def fill(staging: Path) -> str:
        config, tensors, dequantized = hf_vl_config(model), vl_tensors(model), {}
        if quantize is not None:
            tensors = quantized_tensors(tensors, quantize, block, dequantized)
            config["quantization_config"] = quantization_config(quantize, block, vision_language=True)
        write_sharded(staging, tensors, max_shard_bytes)
        (staging / "config.json").write_text(json.dumps(config, indent=2))
        (staging / PREPROCESSOR_CONFIG).write_text(json.dumps(preprocessor_config(processor), indent=2))
        for name, text in (extra_files or {}).items():
            (staging / name).write_text(text, encoding="utf-8")
        if quantize is None:
            return verify_vl_export(model, staging, processor)
        floats = {name: dequantized.get(name, tensor) for name, tensor in vl_tensors(model)}
        expected = vl_model_from_tensors(hf_vl_config(model), set(floats), floats.__getitem__, "the dequantized export",
                                         **{f: getattr(model.text.config, f) for f in RUNTIME_MODEL_FIELDS})
        return (verify_vl_export(expected, staging, processor).replace(
            "the source's configs and logits", f"the configs and logits of the source holding the {quantize} weights' "
            "values") + f"; {quantize}: {len(dequantized)} tensors quantized")

    return write_whole_directory(directory, fill, report)
