"""Post-training demo, stage 2: DPO of the SFT demo's model on its own mistakes.

  python -m zaya_jax.train --config configs/demo_sft.py --workdir runs/demo_sft   # the model to start from
  python -m zaya_jax.preference_pairs --checkpoint runs/demo_sft --output runs/demo_sft_pairs
  python -m zaya_jax.train --config configs/demo_dpo.py --workdir runs/demo_dpo
  python -m zaya_jax.evaluate_tasks --checkpoint runs/demo_dpo                     # held-out accuracy

configs/demo.py's model and trainer as in configs/demo_sft.py, starting from the newest
checkpoint of runs/demo_sft (which is also the frozen reference model) and training on the
on-policy pairs in runs/demo_sft_pairs (zaya_jax.preference_pairs): for each training question
the SFT model answers wrong, chosen = the correct answer and rejected = the model's own answer;
for one it answers right, rejected = a near miss. The trailing 5% of the pairs (training
questions DPO does not train on) are the validation set of the loss, reward margin and
preference accuracy. train.objective=dpo with beta 0.1 and RPO's chosen-answer nll term
(dpo.rpo_alpha 1.0), which keeps the correct answers likely (without it the demo's accuracy
fell: docs/posttraining.md), at a tenth of SFT's learning rate.
"""

import os

from zaya_jax.config_files import load_config_file
from zaya_jax.data import demo_posttrain

STEPS = 60


def get_config():
    config = demo_posttrain.stage_config(
        load_config_file(os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo.py")), "preference", STEPS,
        objective="dpo", init_from="runs/demo_sft", learning_rate=3e-4, path="runs/demo_sft_pairs",
        made_by="python -m zaya_jax.train --config configs/demo_sft.py --workdir {}",
        path_made_by="python -m zaya_jax.preference_pairs --checkpoint runs/demo_sft --output {}")
    config.dpo.update(beta=0.1, label_smoothing=0.0, rpo_alpha=1.0)
    return config
