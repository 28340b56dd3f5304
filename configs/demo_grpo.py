"""Post-training demo, stage 3: GRPO (reinforcement learning on verifiable rewards) of the SFT
demo's model on the generated questions.

  python -m zaya_jax.train --config configs/demo_sft.py --workdir runs/demo_sft    # the model to start from
  python -m zaya_jax.train --config configs/demo_grpo.py --workdir runs/demo_grpo
  python -m zaya_jax.evaluate_tasks --checkpoint runs/demo_grpo                     # held-out accuracy

Starts from the newest checkpoint of runs/demo_sft with a fresh optimizer. Every step samples
8 completions (temperature 1) of each of 64 training questions (demo:tasks: those demo:chat
holds, never a held-out one) from the current weights, rewards each by exact match of its answer
(grpo_rewards.exact_answer), and takes one optimizer step on the clipped policy-ratio loss with
group-normalised advantages (TRL's defaults: dapo normalisation, epsilon 0.2, no KL). AdamW at a
constant 6e-4 for every parameter, 120 steps, chosen by the trainer's held-out evaluations
(benchmarks/demos/grpo_settings.py: 49.2% by step 120): at 3e-4 48.2%; at 3e-4 and temperature 0.7
47.4%; at 3e-4 sampling 3 x 64 questions to train on the 64 whose rewards differ
(grpo.oversample_prompts = 3) 46.6% by step 60 (45.2% without) while sampling three times as
much; 240 steps 50.2%. Muon at 1e-3 and AdamW at 1e-4 left the sampled reward flat, AdamW at
1e-3 and above made it fall, and 16 questions per step were too few.
Each evaluation (halfway and at the end) scores the held-out questions (demo:tasks_heldout) by
greedy generation as evaluate_tasks does: eval/prompts/exact_answer is the held-out accuracy.
Same model, mesh and checkpoints as configs/demo.py at RoPE base 1e5, the SFT checkpoint's;
minutes on 2 CPU cores (benchmarks/demos/grpo_demo.py measures it).
"""

import dataclasses
import os

import ml_collections

from zaya_jax.config_files import load_config_file
from zaya_jax.data import curriculum
from zaya_jax.train.settings import GRPOSettings

STEPS = 120


def get_config():
    config = load_config_file(os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo.py"))
    config.model.rope_theta = 1e5  # the SFT run's (the pretraining demo's last phase)
    config.data = curriculum.demo_data_config()  # its tokenizer and demo settings; the batches are sampled
    config.train.update(steps=STEPS, objective="grpo", init_from_checkpoint="runs/demo_sft",
                        init_from_checkpoint_made_by="python -m zaya_jax.train --config configs/demo_sft.py "
                                                     "--workdir {}", log_every_steps=5)
    config.grpo = ml_collections.ConfigDict({
        **dataclasses.asdict(GRPOSettings()), "prompts": "demo:tasks", "eval_prompts": "demo:tasks_heldout",
        "num_generations": 8, "prompts_per_step": 64, "max_prompt_length": 48, "max_completion_length": 8,
        "temperature": 1.0, "reward_funcs": "exact_answer"})
    config.optimizer.update(name="adamw", learning_rate=6e-4, schedule="constant", warmup_steps=0)
    config.checkpoint.update(every_steps=STEPS, max_to_keep=1)
    config.eval.update(every_steps=STEPS // 2, max_batches=0)
    return config
