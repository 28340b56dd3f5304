"""Post-training demo, stage 1: supervised fine-tuning of the pretraining demo's model.

  python -m zaya_jax.train --config configs/demo.py --workdir runs/demo           # the model to start from
  python -m zaya_jax.train --config configs/demo_sft.py --workdir runs/demo_sft
  python -m zaya_jax.evaluate_tasks --checkpoint runs/demo_sft                     # held-out accuracy

Starts from the newest checkpoint of runs/demo (train.init_from_checkpoint; another with
`--config.train.init_from_checkpoint=DIR`) with a fresh optimizer and its own schedule (Muon,
short warmup, cosine decay), and trains on `demo:chat`: conversations of generated instruction
tasks (zaya_jax/data/instruction_tasks.py) in the plain chat template, the loss on the
assistant's answers only (train.objective=sft). The held-out conversations (exactly the held-out
questions) are the evaluation set. Same model, mesh, balancing and checkpoints as configs/demo.py
at RoPE base 1e5 (that of the pretraining demo's last phase, which its checkpoint holds); a few
minutes on 2 CPU cores.
"""

import os

from zaya_jax.config_files import load_config_file
from zaya_jax.data import demo_posttrain

STEPS = 200


def get_config():
    return demo_posttrain.stage_config(
        load_config_file(os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo.py")), "chat", STEPS,
        objective="sft", init_from="runs/demo", learning_rate=3e-3,
        made_by="python -m zaya_jax.train --config configs/demo.py --workdir {}")
