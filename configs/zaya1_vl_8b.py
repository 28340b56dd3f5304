"""ZAYA1-VL-8B (Zyphra, arXiv 2605.08560): ZAYA1-8B's text model with Qwen2.5-VL's vision tower
(32 blocks of width 1280, 2x2 patch merger to width 2048) and the vision LoRA (ranks 8 on
attention, 32 on the experts), as transformers' `Zaya1VLConfig` has it.

For the planner and for reading the released weights' shapes:
  python -m zaya_jax.planner --config configs/zaya1_vl_8b.py
To train it, add image_chat data (train.data='pipeline', train.objective='sft',
train.patch_capacity, as configs/demo_vl.py does); the trainer names what is missing.
"""

import os

from zaya_jax.config_files import load_config_file, vision_section


def get_config():
    config = load_config_file(os.path.join(os.path.dirname(os.path.abspath(__file__)), "zaya1_8b.py"))
    config.model.vision_lora_rank_attn = 8
    config.model.vision_lora_rank_mlp = 32
    config.vision = vision_section()
    return config
