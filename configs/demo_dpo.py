"""Post-training demo, stage 2: DPO of the SFT demo's model on preference pairs.

  python -m zaya_jax.train --config configs/demo_sft.py --workdir runs/demo_sft   # the model to start from
  python -m zaya_jax.train --config configs/demo_dpo.py --workdir runs/demo_dpo
  python -m zaya_jax.evaluate_tasks --checkpoint runs/demo_dpo                     # held-out accuracy

configs/demo.py's model and trainer as in configs/demo_sft.py, starting from the newest
checkpoint of runs/demo_sft (which is also the frozen reference model) and training on
`demo:preference`: the same generated questions, chosen = the correct answer, rejected = a near miss (the answer off by one or two).
train.objective=dpo with beta 0.1 and a tenth of SFT's learning rate; the loss, reward margin and
preference accuracy are also evaluated on the held-out pairs.
"""

import os

from zaya_jax.config_files import load_config_file
from zaya_jax.data import demo_posttrain

STEPS = 60


def get_config():
    config = demo_posttrain.stage_config(
        load_config_file(os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo.py")), "preference", STEPS,
        objective="dpo", init_from="runs/demo_sft", learning_rate=3e-4,
        made_by="python -m zaya_jax.train --config configs/demo_sft.py --workdir {}")
    config.dpo.update(beta=0.1, label_smoothing=0.0)
    return config
