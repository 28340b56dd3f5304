"""Scoring a model by greedy generation: a checkpoint's model answering prompts (answering.py), the
instruction tasks' exact-match accuracy (tasks.py) and a vision-language model's on the held-out
digits (digit_accuracy.py). `python -m zaya_jax.evaluate_tasks` and zaya_jax.preference_pairs are
their CLIs; GRPO's rollouts complete prompts with answering.generate_completions."""
