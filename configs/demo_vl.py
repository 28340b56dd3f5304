"""The vision-language demo: a ZAYA1-VL made from the pretraining demo's text model.

  python -m zaya_jax.train --config configs/demo.py --workdir runs/demo           # the text model
  python -m zaya_jax.train --config configs/demo_vl.py --workdir runs/demo_vl
  python -m zaya_jax.evaluate_tasks --checkpoint runs/demo_vl        # held-out digits: plain and 5 variants
  python -m zaya_jax.generate --checkpoint runs/demo_vl --image digit.png --prompt "Which digit is this?"

Starts from the newest checkpoint of runs/demo (train.init_from_checkpoint): its text model gets
a small Qwen2.5-VL tower (2 blocks of width 64, 4x4-pixel patches, the 2x2 merger to the text
width 128, full attention in block 1) and the vision LoRA (ranks 8 on attention, 32 on the
experts, as ZAYA1-VL-8B), and trains on `demo:digits` (zaya_jax.data.vision.demo_source: scikit-learn's
handwritten digits as conversations "Which digit is this?" -> the digit, each 16x16 image 4 image
tokens) with the loss on the answer only. The text model's weights and balancing biases stay
frozen (train.freeze_text: the tower, merger and LoRA learn to speak to it, so the text model
computes exactly what it did on text); `--config.train.freeze_text=false` trains everything.
The training digits are augmented (train.augment_*: moved, resized, their contrast changed; drawn
anew each epoch, zaya_jax.data.vision.augment), so that a digit drawn elsewhere in the frame or at
another size or fainter is read too. The 359 held-out digits are the evaluation set; `evaluate_tasks`
scores them by generation as they are, moved by one pixel and by two along each axis, drawn at
0.75x / 1.25x and all at 0.75x, and at 60% contrast (benchmarks/demos/vl_demo.py: over seeds, per Python).
"""

import os

from zaya_jax.config_files import load_config_file, vision_section
from zaya_jax.data import demo_posttrain
from zaya_jax.data.vision import demo_source

STEPS = 600  # the wider augmentation below needs more steps than the narrower one's 300 (README: at 300 it was left undertrained)
PATCHES = 80  # a row of 128 positions holds about 4 conversations of ~28 tokens, of 16 patches each
# each training digit moved by up to 30% of its side along each axis, resized by 0.7x-1.3x and its contrast
# by 0.55x-1.45x (zaya_jax.data.vision.augment), drawn anew each epoch: past the held-out variants (a move of 2 of
# 8 pixels along each axis, 25%; drawn at 6 or 10 of 8 pixels, 0.75x / 1.25x; contrast 0.6;
# benchmarks/demos/vl_demo.py). The ranges were 0.15, 0.25, 0.3 (300 steps), which reach none of the three
AUGMENT_SHIFT, AUGMENT_SCALE, AUGMENT_CONTRAST = 0.3, 0.3, 0.45


def get_config():
    config = demo_posttrain.stage_config(
        load_config_file(os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo.py")), "digits", STEPS,
        objective="sft", init_from="runs/demo", learning_rate=3e-3,
        made_by="python -m zaya_jax.train --config configs/demo.py --workdir {}")
    config.data.heldout_fraction = demo_source.HELDOUT_FRACTION
    config.model.vision_lora_rank_attn = 8
    config.model.vision_lora_rank_mlp = 32
    ids = demo_source.DEMO_IMAGE_IDS
    config.vision = vision_section(
        depth=2, hidden_size=64, intermediate_size=128, num_heads=2, patch_size=demo_source.PATCH_SIZE,
        spatial_merge_size=demo_source.MERGE_SIZE, window_size=16, fullatt_block_indexes=[1], out_hidden_size=128,
        image_token_id=ids.image, vision_start_token_id=ids.vision_start, vision_end_token_id=ids.vision_end,
        min_pixels=demo_source.DIGIT_PIXELS, max_pixels=demo_source.DIGIT_PIXELS)  # generation resizes as the data
    config.train.update(patch_capacity=PATCHES, freeze_text=True, augment_shift=AUGMENT_SHIFT,
                        augment_scale=AUGMENT_SCALE, augment_contrast=AUGMENT_CONTRAST)
    return config
