"""ZAYA1-VL in the planner (zaya_jax.model.vision.accounting): ZAYA1-VL-8B's parameters are the report's
9.2B without the embedding, 1.4B active; the tower's count is transformers' Qwen2.5-VL tower's
(built on the meta device from ZAYA1-VL-8B's vision config), the LoRA's is the reference's shapes';
the tower's forward FLOPs are XLA's cost analysis of the compiled tower; the planner CLI prints
them, and the trainer names what the config lacks to train it (image_chat data) instead of training its
text model alone."""

import dataclasses
import json
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from zaya_jax.config import ConfigError
from zaya_jax.config_files import load_config_file, model_config, vision_config
from zaya_jax.model.vision.accounting import tower_forward_flops, vl_model_summary
from zaya_jax.model.vision.config import VisionConfig
from zaya_jax.model.vision.layout import patch_layout
from zaya_jax.model.vision.tower import VisionTower
from zaya_jax.train.settings import settings_from_config

CONFIG = "configs/zaya1_vl_8b.py"


@pytest.fixture(scope="module")
def summary():
    config = load_config_file(CONFIG)
    return vl_model_summary(model_config(config), vision_config(config)[0])


def test_zaya1_vl_8b_counts_are_the_reports(summary):
    assert summary["params_non_embedding"] == pytest.approx(9.2e9, abs=0.05e9)        # 9.185B
    assert summary["params_active_non_embedding"] == pytest.approx(1.4e9, abs=0.05e9)  # 1.439B
    assert sum(summary["breakdown"].values()) == summary["params_total"]
    # the text model's (ZAYA1-8B: test_plan's 8.30B / 0.754B) plus the tower and the LoRA, one expert's active
    b = summary["breakdown"]
    lora_e = b["vision LoRA (experts)"]
    tower = summary["vision"]["params"]
    assert summary["params_active_non_embedding"] - tower - b["vision LoRA (attention)"] - lora_e // 16 == (
        pytest.approx(0.754e9, abs=0.002e9))
    d, n, k, h, e, i, r_a, r_m, layers = 2048, 8, 2, 128, 16, 2048, 8, 32, 40   # the reference's LoRA shapes
    attention = (r_a * d + n * h * r_a) + (r_a * d + k * h * r_a) + 2 * (r_a * d + k * h // 2 * r_a) + (
        r_a * n * h + d * r_a)
    assert b["vision LoRA (attention)"] == layers * attention
    assert lora_e == layers * e * (r_m * d + 2 * i * r_m + r_m * i + d * r_m)
    assert summary["vision"]["image"] == {"pixels": [448, 448], "resized_to": [448, 448], "patches": 1024,
                                          "tokens": 256, "forward_flops": tower_forward_flops(VisionConfig(), 1024)}


@pytest.mark.torch_reference
def test_the_tower_count_is_transformers_qwen2_5_vl_tower(summary):
    import torch
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    vision = vision_config(load_config_file(CONFIG))[0]
    fields = {f.name: getattr(vision, f.name) for f in dataclasses.fields(vision)
              if f.name not in ("dtype", "rope_theta", "rms_norm_eps")}
    with torch.device("meta"):
        tower = Qwen2_5_VisionTransformerPretrainedModel(Qwen2_5_VLVisionConfig(**fields))
    assert summary["vision"]["params"] == sum(p.numel() for p in tower.parameters()) == 667_931_648


def test_tower_forward_flops_are_xlas_cost_analysis():
    """One block (XLA's cost analysis counts a scan's body once), widths where matmuls dominate, an
    image of 8 x 12 patches (windowed: the XLA path's dense scores cost what a full block's do)."""
    vision = VisionConfig(depth=1, hidden_size=128, intermediate_size=192, num_heads=4, patch_size=4, window_size=16,
                          fullatt_block_indexes=(), out_hidden_size=96)
    grid = (1, 8, 12)
    layout = patch_layout([grid], vision)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: VisionTower(vision, rngs=nnx.Rngs(0))))
    args = (jax.ShapeDtypeStruct((1, 96, vision.patch_dim), np.float32),
            *(jax.ShapeDtypeStruct((1, *a.shape), a.dtype) for a in layout[:3]))
    cost = jax.jit(lambda s, *a: nnx.merge(graphdef, s)(*a)).lower(state, *args).compile().cost_analysis()
    xla = (cost[0] if isinstance(cost, list) else cost)["flops"]
    assert tower_forward_flops(vision, 96) == pytest.approx(xla, rel=0.05)   # 0.968; without the scores 0.872


def test_the_planner_prints_them_and_the_trainer_names_what_the_config_lacks(summary):
    env = {"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-m", "zaya_jax.planner", "--config", CONFIG, "--json",
                          "--image_size", "1000x700"], capture_output=True, text=True, check=True, env=env)
    printed = json.loads(out.stdout)
    assert printed["params_total"] == summary["params_total"]
    assert printed["vision"]["image"]["resized_to"] == [1008, 700] and printed["vision"]["image"]["tokens"] == 900
    # the step plan (tests/test_plan_vision.py) is a vision run's: the trainer's checks name what is wrong
    out = subprocess.run([sys.executable, "-m", "zaya_jax.planner", "--config", CONFIG, "--mesh", "data=8",
                          "--config.train.objective=lm"], capture_output=True, text=True, env=env)
    assert out.returncode == 2 and out.stderr.startswith("error: a vision-language run (the config has a vision "
                                                         "section): train.objective must be 'sft'"), out.stderr
    config = load_config_file(CONFIG)
    config.train.patch_capacity = 0
    with pytest.raises(ConfigError, match="a vision-language run .*: train.patch_capacity must be a positive"):
        settings_from_config(config)
