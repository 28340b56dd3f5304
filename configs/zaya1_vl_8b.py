"""ZAYA1-VL-8B (Zyphra, arXiv 2605.08560): ZAYA1-8B's text model with Qwen2.5-VL's vision tower
(32 blocks of width 1280, 2x2 patch merger to width 2048) and the vision LoRA (ranks 8 on
attention, 32 on the experts), as transformers' `Zaya1VLConfig` has it.

For the planner and for reading the released weights' shapes:
  python -m zaya_jax.planner --config configs/zaya1_vl_8b.py [--mesh data=64,fsdp=8 | --hardware h200 ...]
The step it plans is a vision run's (train.settings.check_vision_run): train.objective='sft', 4,096
patches per row (four 448x448 images, 1,024 tokens of a 4,096-token row), mesh.context = 1 (image
tokens attend across the sequence), the text model trained too (--config.train.freeze_text=true
freezes it); batch, sequence length and curriculum are zaya1_8b.py's. To train it, point
data.sources at image_chat data (as configs/demo_vl.py does); the trainer names what is missing.
"""

import os

from zaya_jax.config_files import load_config_file, vision_section


def get_config():
    config = load_config_file(os.path.join(os.path.dirname(os.path.abspath(__file__)), "zaya1_8b.py"))
    config.model.vision_lora_rank_attn = 8
    config.model.vision_lora_rank_mlp = 32
    config.vision = vision_section()
    config.train.update(objective="sft", patch_capacity=4096, freeze_text=False)
    config.mesh.context = 1
    return config
